// hxfer's end-to-end benchmark workloads (`hxfer bench <workload>`, docs/performance.md), a
// library in the spirit of leveldb's db_bench: the `hxfer` command is a thin front
// (src/cli/bench_workloads_cmd.cc) that parses the options and calls runWorkloads.
//
//   baseline     memcpy of a request's bytes with the request's op sizes, and a raw TCP
//                loopback socket pair moving the same bytes;
//   request      one request's whole state (KV for T tokens + recurrent state), ctx -> gen,
//                over each backend, for T in `tokens`;
//   mismatch     the same at several ctx:gen TP pairs (ratio to the matched pair);
//   small-pages  tokens_per_block 16 against a large page, with many layers: ops per request
//                after coalescing against the number of contiguous runs, and goodput;
//   storm        nhd and token-major kv (trtllm-v2 nhd, sglang) at tp mismatch with small
//                pages against hnd: ops, bytes per op, goodput;
//   copy-bandwidth  one request against memcpy of its bytes on 1..N threads (N = cores);
//   streaming    prefill simulated per layer; the time from its end to the request complete,
//                layers streamed as they finish against the request marked ready whole;
//   load         N requests at concurrency C: requests/s, GB/s, latency percentiles;
//   control      round trip of a request with zero payload (protocol overhead).
//
// Not thread-safe: one run at a time (its load workers are the only other threads).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/model.h"

namespace hxfer::bench {

struct WorkloadOptions {
  ModelSpec model;  // resolved (a preset or a config.json)
  uint32_t ctx_tp = 1, gen_tp = 1;
  std::string backends;     // comma list; empty = the workload's default
  std::string tokens;       // comma list with k/m suffixes; empty = the workload's default
  std::string tp_pairs;     // "ctx:gen,..." (mismatch, small-pages); empty = default
  std::string layers;       // small-pages: layer counts (the model's pattern repeated)
  std::string concurrency;  // load: comma list
  uint32_t small_block = 16, large_block = 256;
  uint32_t requests = 128;  // load: timed requests per configuration
  uint32_t control_rounds = 2000;
  // control: CPU-bound threads spinning beside the round trips for the whole workload, as a
  // serving engine's busy loops do beside hxfer's threads (0: none).
  uint32_t busy_threads = 0;
  double prefill_us_per_token = 40;       // streaming: simulated prefill cost (whole model)
  uint64_t stream_min_tokens = 512;       // streaming: ContextSender::Options::stream_min_tokens
  uint64_t staging_bytes = 512ull << 20;  // storm: the generation ranks' staging regions
  int repetitions = 5;
  int warmup = 1;
  bool no_verify = false;
  bool quiet = false;
  std::string json_path, csv_path, plot_path;
};

struct WorkloadInfo {
  const char* name;
  const char* help;
};

// Every workload, in the order `all` runs them.
const std::vector<WorkloadInfo>& workloads();

// Runs the named workloads into one report: tables on stdout, and the JSON, CSV and SVG files
// the options name. Errors name the workload (or the option) and why.
Status runWorkloads(const WorkloadOptions& options, const std::vector<std::string>& names);

}  // namespace hxfer::bench
