// `hxfer bench <workload>` and `hxfer bench all`: the command line of the benchmark workloads
// (bench/workloads/workloads.h, where they live and are described). `hxfer bench transport`,
// the raw backend benchmark, is bench_cmd.cc.
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "workloads/workloads.h"

namespace hxfer::cli {
namespace {

struct Options {
  ModelOptions model;
  bench::WorkloadOptions workload;  // .model is resolved from `model` when the command runs
};

int run(Options o, const std::vector<std::string>& names) {
  auto model = resolveModel(o.model);
  if (!model.isOk()) return reportError(model.status());
  o.workload.model = *model;
  const Status s = bench::runWorkloads(o.workload, names);
  return s.isOk() ? 0 : reportError(s);
}

void addWorkloadOptions(CLI::App* cmd, Options* opts) {
  bench::WorkloadOptions* o = &opts->workload;
  opts->model.model = "nemotron-h-8b";  // a realistic hybrid: 4 attention + 24 mamba2 layers
  addModelOptions(cmd, &opts->model);
  if (auto* m = cmd->get_option_no_throw("--model")) m->default_str("nemotron-h-8b");
  cmd->add_option("--ctx-tp", o->ctx_tp, "context TP size (request, baseline, load)")
      ->capture_default_str();
  cmd->add_option("--gen-tp", o->gen_tp, "generation TP size (request, baseline, load)")
      ->capture_default_str();
  cmd->add_option("--backend", o->backends,
                  "comma list of shm, ucx, inproc (default depends on the workload)");
  cmd->add_option(
      "--tokens", o->tokens,
      "comma list of request lengths, k = 1024, m = 1024^2 (default depends on the workload)");
  cmd->add_option("--tp-pairs", o->tp_pairs, "ctx:gen TP pairs (mismatch, small-pages)");
  cmd->add_option(
      "--layers", o->layers,
      "small-pages: layer counts (k, m as for --tokens); the model's layer pattern is repeated");
  cmd->add_option("--small-block", o->small_block, "small-pages: small tokens_per_block")
      ->capture_default_str();
  cmd->add_option("--large-block", o->large_block, "small-pages: reference tokens_per_block")
      ->capture_default_str();
  cmd->add_option("--requests", o->requests, "load: timed requests per configuration")
      ->capture_default_str();
  cmd->add_option("--concurrency", o->concurrency,
                  "load: comma list of requests in flight (k, m as for --tokens)");
  cmd->add_option("--prefill-us-per-token", o->prefill_us_per_token,
                  "streaming: simulated prefill cost per token (whole model), spread evenly "
                  "over the layers")
      ->capture_default_str();
  cmd->add_option("--stream-min-tokens", o->stream_min_tokens,
                  "streaming: requests shorter than this go whole after their last layer")
      ->capture_default_str();
  cmd->add_option("--staging-bytes", o->staging_bytes,
                  "storm: each generation rank's staging region for its staged rows")
      ->capture_default_str();
  cmd->add_option("--rounds", o->control_rounds, "control: timed round trips")
      ->capture_default_str();
  cmd->add_option("--busy-threads", o->busy_threads,
                  "control: CPU-bound threads spinning beside the round trips, as a serving "
                  "engine's busy loops do")
      ->check(CLI::Range(0u, 256u))
      ->capture_default_str();
  cmd->add_option("--repetitions", o->repetitions, "timed runs per configuration")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed runs first")->capture_default_str();
  cmd->add_flag("--no-verify", o->no_verify, "skip the oracle check of received bytes");
  cmd->add_flag("--quiet", o->quiet, "no progress line");
  cmd->add_option("--json", o->json_path, "write every result as JSON to FILE");
  cmd->add_option("--csv", o->csv_path, "write every result as CSV to FILE");
  cmd->add_option("--plot", o->plot_path, "write an SVG plot to FILE.svg");
}

}  // namespace

void addBenchWorkloadsCommand(CLI::App& app) {
  // `hxfer bench` itself (and `bench transport`) come from addBenchCommand; the workloads join
  // it as further subcommands, or create it when that command is not built in.
  auto found = app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; });
  CLI::App* bench = found.empty() ? nullptr : found.front();
  if (bench == nullptr) {
    bench = app.add_subcommand(
        "bench",
        "Measure hxfer components against baselines; `hxfer bench` alone runs every workload "
        "(all)");
  }
  std::vector<std::string> every;
  for (const bench::WorkloadInfo& w : bench::workloads()) {
    every.push_back(w.name);
    auto* cmd = bench->add_subcommand(w.name, w.help);
    auto o = std::make_shared<Options>();
    addWorkloadOptions(cmd, o.get());
    cmd->callback([o, name = std::string(w.name)] {
      const int rc = run(*o, {name});
      if (rc != 0) throw CLI::RuntimeError(rc);
    });
  }
  auto* all = bench->add_subcommand("all",
                                    "every workload above, in one report (also what "
                                    "`hxfer bench` alone runs)");
  auto o = std::make_shared<Options>();
  addWorkloadOptions(all, o.get());
  auto run_all = [o, every] {
    const int rc = run(*o, every);
    if (rc != 0) throw CLI::RuntimeError(rc);
  };
  all->callback(run_all);
  // `hxfer bench` with no workload runs them all, with their defaults.
  bench->require_subcommand(0, 1);
  bench->callback([bench, run_all] {
    if (bench->get_subcommands().empty()) run_all();
  });
}

}  // namespace hxfer::cli
