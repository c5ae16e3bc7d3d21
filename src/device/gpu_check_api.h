// hxfer-gpu-check's engine row (gpu_check_api.cc): one request of a hybrid model through the
// public API (Sender and Receiver) between two ranks of this process, every pool in device
// memory, behind the engine's events.
#pragma once

#include <cstdint>
#include <string>

namespace hxfer::device {

struct ApiResult {
  bool ran = false;    // both requests ended; the figures below are real
  bool exact = false;  // the oracle found every generation byte of both requests
  // While the engine's events were pending (the context's "layers ready" and the generation's
  // "pages free", both behind a gate the check holds for 100 ms), no generation byte changed
  // and the request was in progress.
  bool fence_held = false;
  bool packed = false;  // the pair's plan packs (conv sd against ds): done on the device
  uint64_t bytes = 0;   // moved by the timed request
  double ms = 0;        // the timed request (no events), start to done
  std::string why;      // what went wrong when !ran
};

// `tokens` tokens of preset `model` from a vllm rank (conv sd) to an sglang rank on device 0:
// over the CUDA runtime, or over FakeDevice (`fake`: no GPU needed). `backend`: "cuda" (the
// same-host path), or "ucx" (the path across hosts, over loopback TCP: each part copied on the
// device into pinned host memory, staged at the generation rank and copied in there: whole,
// or with `staging_bytes` smaller than the part window by window through half of it).
ApiResult apiCheck(bool fake, const std::string& model, uint32_t tokens,
                   const std::string& backend = "cuda", uint64_t staging_bytes = 1ull << 30);

// The path across hosts in two processes over FakeDevice (each may run in a network namespace
// of its own): `side` "ctx" serves `requests` requests of a vllm rank (conv sd) with device
// pools over ucx on `address` (LISTEN, e.g. 10.0.0.1:0), printing "context listening on ADDR"
// first and "context: N of N answered" once the generation rank took them; "gen" asks the
// context rank at `address` for them into an sglang rank's device pools and checks each with
// the oracle ("generation: N of N exact"). 0 when every request went; 1 otherwise.
int fakeAcross(const std::string& side, const std::string& address, uint32_t requests);

}  // namespace hxfer::device
