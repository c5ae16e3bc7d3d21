// `hxfer plan`: prints the transfer plan between a context and a generation instance of a model
// (ops and bytes per context rank -> generation rank pair), and with --verify runs it: every
// rank's pools are allocated in this process, the context side is filled with the oracle, the
// plan runs with memcpy, and every destination byte is checked and counted.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "plan/local_transfer.h"

namespace hxfer::cli {
namespace {

struct PlanOptions {
  ModelOptions model;
  uint32_t ctx_tp = 1, gen_tp = 1, ctx_pp = 1, gen_pp = 1;
  std::string ctx_layout = "paged", gen_layout = "paged";
  bool ctx_layout_given = false, gen_layout_given = false;  // on the command line
  EngineOptions ctx_engine, gen_engine;
  uint32_t tokens = 1024;
  uint32_t prefix_tokens = 0;
  std::string block_ids = "contiguous";
  uint64_t seed = 1;
  bool verify = false;
  bool json = false;
};

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

int run(const PlanOptions& o) {
  auto model = resolveModel(o.model);
  if (!model.isOk()) return reportError(model.status());
  // --ctx-layout / --gen-layout choose hxfer's own state layout; other engines have one.
  auto ctx_layout = resolveEngineLayout(o.ctx_engine, "ctx", o.ctx_layout, o.ctx_layout_given);
  if (!ctx_layout.isOk()) return reportError(ctx_layout.status());
  auto gen_layout = resolveEngineLayout(o.gen_engine, "gen", o.gen_layout, o.gen_layout_given);
  if (!gen_layout.isOk()) return reportError(gen_layout.status());

  LocalTransferOptions t;
  t.ctx = {o.ctx_tp, o.ctx_pp, {}};
  t.gen = {o.gen_tp, o.gen_pp, {}};
  t.ctx_engine = *ctx_layout;
  t.gen_engine = *gen_layout;
  t.ctx_tokens_per_block = sideModel(*model, o.ctx_engine).tokens_per_block;
  t.gen_tokens_per_block = sideModel(*model, o.gen_engine).tokens_per_block;
  t.tokens = o.tokens;
  t.prefix_tokens = o.prefix_tokens;
  t.shuffle_blocks = o.block_ids == "shuffled";
  t.seed = o.seed;
  t.execute = o.verify;
  t.check_coverage = o.verify;
  t.use_regions = true;
  auto r = runLocalTransfer(*model, t);
  if (!r.isOk()) return reportError(r.status());

  if (o.json) {
    nlohmann::json j;
    j["model"] = model->name;
    j["ctx"] = {{"tp", o.ctx_tp}, {"pp", o.ctx_pp}, {"layout", ctx_layout->toString()}};
    j["gen"] = {{"tp", o.gen_tp}, {"pp", o.gen_pp}, {"layout", gen_layout->toString()}};
    j["tokens"] = o.tokens;
    j["ctx"]["tokens_per_block"] = t.ctx_tokens_per_block;
    j["gen"]["tokens_per_block"] = t.gen_tokens_per_block;
    j["first_block"] = r->blocks.first_block;
    j["num_blocks"] = r->blocks.num_blocks;
    j["total_bytes"] = r->total_bytes;
    j["total_ops"] = r->total_ops;
    j["total_pack_ops"] = r->total_pack_ops;
    j["expected_bytes"] = r->expected_bytes;
    j["pairs"] = nlohmann::json::array();
    for (const PairStats& p : r->pairs) {
      j["pairs"].push_back({{"ctx_tp_rank", p.ctx_tp_rank},
                            {"ctx_pp_rank", p.ctx_pp_rank},
                            {"gen_tp_rank", p.gen_tp_rank},
                            {"gen_pp_rank", p.gen_pp_rank},
                            {"ops", p.ops},
                            {"bytes", p.bytes}});
    }
    if (o.verify) {
      j["verified"] = r->verified();
      j["bytes_checked"] = r->oracle.bytes_checked;
      if (!r->verified()) {
        j["oracle"] = r->oracle.toString();
        j["coverage_errors"] = r->coverage_errors;
        j["first_coverage_error"] = r->first_coverage_error;
      }
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    const uint32_t ct = t.ctx_tokens_per_block, gt = t.gen_tokens_per_block;
    const std::string blocks = ct == gt
                                   ? std::string()
                                   : " (tokens per block: ctx " + std::to_string(ct) + ", gen " +
                                         std::to_string(gt) + "; kv by token ranges)";
    std::printf(
        "model %s: ctx tp%u pp%u %s -> gen tp%u pp%u %s, %u tokens, blocks [%u, %u) sent%s\n",
        model->name.c_str(), o.ctx_tp, o.ctx_pp, ctx_layout->toString().c_str(), o.gen_tp, o.gen_pp,
        gen_layout->toString().c_str(), o.tokens, r->blocks.first_block,
        static_cast<uint32_t>(r->blocks.end()), blocks.c_str());
    for (const PairStats& p : r->pairs) {
      std::printf("  ctx (tp %u, pp %u) -> gen (tp %u, pp %u): %llu ops, %llu bytes (%s)\n",
                  p.ctx_tp_rank, p.ctx_pp_rank, p.gen_tp_rank, p.gen_pp_rank,
                  static_cast<unsigned long long>(p.ops), static_cast<unsigned long long>(p.bytes),
                  mib(p.bytes).c_str());
    }
    std::printf("total: %llu ops, %llu bytes (%s)", static_cast<unsigned long long>(r->total_ops),
                static_cast<unsigned long long>(r->total_bytes), mib(r->total_bytes).c_str());
    if (r->total_pack_ops != 0) {
      std::printf("; %llu staging gathers on the context ranks (element order differs)",
                  static_cast<unsigned long long>(r->total_pack_ops));
    }
    std::printf("\n");
    if (o.verify) {
      if (r->verified()) {
        std::printf("verified: %llu bytes checked on %u generation ranks\n",
                    static_cast<unsigned long long>(r->oracle.bytes_checked), o.gen_tp * o.gen_pp);
      } else {
        std::printf(
            "verification FAILED: oracle %s; %llu coverage errors%s%s; bytes %llu, "
            "expected %llu\n",
            r->oracle.toString().c_str(), static_cast<unsigned long long>(r->coverage_errors),
            r->first_coverage_error.empty() ? "" : ", first: ", r->first_coverage_error.c_str(),
            static_cast<unsigned long long>(r->total_bytes),
            static_cast<unsigned long long>(r->expected_bytes));
      }
    }
  }
  return o.verify && !r->verified() ? 1 : 0;
}

}  // namespace

void addPlanCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Plan a request's transfer between two parallel layouts (--verify: run and check it)");
  auto o = std::make_shared<PlanOptions>();
  addModelOptions(cmd, &o->model);
  addParallelSize(cmd, "--ctx-tp", &o->ctx_tp, "Context tensor parallel size", 1);
  addParallelSize(cmd, "--gen-tp", &o->gen_tp, "Generation tensor parallel size", 1);
  addParallelSize(cmd, "--ctx-pp", &o->ctx_pp, "Context pipeline parallel size", 1);
  addParallelSize(cmd, "--gen-pp", &o->gen_pp, "Generation pipeline parallel size", 1);
  auto* ctx_layout =
      cmd->add_option("--ctx-layout", o->ctx_layout,
                      "Context state layout of --ctx-engine hxfer (refused with another "
                      "engine): paged or layer-major")
          ->default_val("paged");
  auto* gen_layout =
      cmd->add_option("--gen-layout", o->gen_layout,
                      "Generation state layout of --gen-engine hxfer (refused with another "
                      "engine): paged or layer-major")
          ->default_val("paged");
  addEngineOptions(cmd, &o->ctx_engine, "ctx");
  addEngineOptions(cmd, &o->gen_engine, "gen");
  cmd->add_option("--tokens", o->tokens, "Request length in tokens")
      ->default_val(1024)
      ->check(CLI::Range(1u, 1u << 30));
  cmd->add_option("--prefix-tokens", o->prefix_tokens,
                  "Tokens the generation side already holds (whole blocks are not sent)")
      ->default_val(0);
  cmd->add_option("--block-ids", o->block_ids,
                  "Block ids per rank: contiguous (offset per rank) or shuffled")
      ->default_val("contiguous")
      ->check(CLI::IsMember({"contiguous", "shuffled"}));
  cmd->add_option("--seed", o->seed, "Seed for shuffled block ids")->default_val(1);
  cmd->add_flag("--verify", o->verify,
                "Allocate every rank's pools, run the plan with memcpy and check every byte");
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->callback([o, ctx_layout, gen_layout] {
    o->ctx_layout_given = ctx_layout->count() > 0;
    o->gen_layout_given = gen_layout->count() > 0;
    const int rc = run(*o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace hxfer::cli
