// hxfer-gpu-check: what docs/gpu.md's kernels do on the GPU of this machine, in one run that
// prints a table and "N passed, N failed". Each figure is a ratio against a baseline measured
// in the same run (the device's own cudaMemcpy D2D). scripts/gpu-check.sh builds and runs it
// with the GPU tests. Exits 0 when every check passed, 1 when one failed, 2 without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device/gpu_check_api.h"
#include "device/gpu_check_ipc.h"
#include "device/kernels.h"

namespace hxfer::device {
namespace {

struct Row {
  std::string check;
  bool ok = false;
  std::string figure;
  std::string target;
};
std::vector<Row> rows;

void row(std::string check, bool ok, std::string figure, std::string target = "") {
  rows.push_back({std::move(check), ok, std::move(figure), std::move(target)});
}

std::string fmt(const char* f, double a) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, a);
  return buf;
}

bool cudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return false;
}

struct DeviceBuffer {
  explicit DeviceBuffer(uint64_t n) : bytes(n) { cudaOk(cudaMalloc(&ptr, n), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
  void* ptr = nullptr;
  uint64_t bytes = 0;
};

// Best of `reps` timings of fn() in milliseconds, by CUDA events on the default stream (fn
// may also synchronize itself).
double bestMs(int reps, const std::function<bool()>& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    if (!fn()) return -1;
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, static_cast<double>(ms));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

double gbps(uint64_t bytes, double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0; }

// The device's D2D copy of `bytes` in one cudaMemcpy: the ceiling the kernels are read against.
double ceilingGbps(uint64_t bytes) {
  DeviceBuffer a(bytes), b(bytes);
  cudaMemset(a.ptr, 1, bytes);
  const double ms = bestMs(5, [&] {
    return cudaOk(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice), "D2D");
  });
  return gbps(bytes, ms);
}

void stormCheck(double ceiling) {
  constexpr uint32_t kRuns = 262'528;
  constexpr uint64_t kRun = 512;
  const uint64_t total = uint64_t{kRuns} * kRun;
  std::vector<uint8_t> host(total), back(total);
  std::mt19937_64 rng(5);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  DeviceBuffer src(total), dst(total);
  cudaMemcpy(src.ptr, host.data(), total, cudaMemcpyHostToDevice);
  const ShuffledRuns storm = shuffledRuns(reinterpret_cast<uint64_t>(src.data()),
                                          reinterpret_cast<uint64_t>(dst.data()), kRuns, kRun, 5);
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes(kRuns, kRun);
  for (const CopyRun& r : storm.runs) {
    srcs.push_back(reinterpret_cast<const void*>(r.src));
    dsts.push_back(reinterpret_cast<void*>(r.dst));
  }
  auto table = copyTable(storm.runs);
  cudaMemset(dst.ptr, 0, total);
  const double kernel_ms = bestMs(5, [&] { return copyOnDevice(*table).isOk(); });
  cudaMemcpy(back.data(), dst.ptr, total, cudaMemcpyDeviceToHost);
  bool exact = true;
  for (uint32_t i = 0; i < kRuns && exact; ++i) {
    exact = std::memcmp(back.data() + storm.destinationOffset(i), host.data() + uint64_t{i} * kRun,
                        kRun) == 0;
  }
  const double k = gbps(total, kernel_ms);
  row("storm 262,528 x 512 B, batched kernel (table upload included)", exact && k >= 0.5 * ceiling,
      fmt("%.1f GB/s", k) + fmt(" = %.2fx D2D", k / ceiling), ">= 0.5x D2D, bytes exact");
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const double batch_ms = bestMs(5, [&] {
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), kRuns, &attr,
                                         &attr_index, 1, stream);
#else
    size_t fail = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()),
                                         sizes.data(), kRuns, &attr, &attr_index, 1, &fail, stream);
#endif
    return cudaOk(e, "cudaMemcpyBatchAsync") && cudaOk(cudaStreamSynchronize(stream), "sync");
  });
  cudaStreamDestroy(stream);
  const double b = gbps(total, batch_ms);
  row("storm through cudaMemcpyBatchAsync (baseline)", batch_ms > 0,
      fmt("%.1f GB/s", b) + fmt("; kernel = %.2fx it", k / std::max(b, 1e-9)));
#endif
  const double per_run_ms = bestMs(1, [&] {
    for (uint32_t i = 0; i < kRuns; ++i) {
      if (!cudaOk(cudaMemcpyAsync(dsts[i], srcs[i], kRun, cudaMemcpyDeviceToDevice), "run")) {
        return false;
      }
    }
    return true;
  });
  const double p = gbps(total, per_run_ms);
  row("storm as one cudaMemcpyAsync per run (baseline)", per_run_ms > 0,
      fmt("%.2f GB/s", p) + fmt("; kernel = %.1fx it", k / std::max(p, 1e-9)));
}

// vLLM's conv state SD [3][conv_dim] into DS [conv_dim][3] (bf16) for 4096 boxes of a
// Nemotron-H-sized conv_dim of 10240: ~250 MB through the pack kernel.
void packCheck(double ceiling) {
  constexpr uint64_t kBoxes = 4096, kConv = 10240, kWidth = 3, kElem = 2;
  const uint64_t box = kWidth * kConv * kElem, total = kBoxes * box;
  std::vector<uint8_t> host(total), back(total), want(total);
  std::mt19937_64 rng(9);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  DeviceBuffer src(total), dst(total);
  cudaMemcpy(src.ptr, host.data(), total, cudaMemcpyHostToDevice);
  HostPackTable t;
  t.first_element.push_back(0);
  for (uint64_t i = 0; i < kBoxes; ++i) {
    Pack p;
    p.src = reinterpret_cast<uint64_t>(src.data() + i * box);
    p.dst = reinterpret_cast<uint64_t>(dst.data() + i * box);
    p.element_bytes = kElem;
    p.ndims = 2;  // destination order: [conv_dim][width]
    p.size[0] = kConv;
    p.src_stride[0] = kElem;
    p.dst_stride[0] = kWidth * kElem;
    p.size[1] = kWidth;
    p.src_stride[1] = kConv * kElem;
    p.dst_stride[1] = kElem;
    t.packs.push_back(p);
    t.first_element.push_back(t.first_element.back() + kConv * kWidth);
    for (uint64_t c = 0; c < kConv; ++c) {
      for (uint64_t w = 0; w < kWidth; ++w) {
        std::memcpy(&want[i * box + (c * kWidth + w) * kElem],
                    &host[i * box + (w * kConv + c) * kElem], kElem);
      }
    }
  }
  const double ms = bestMs(5, [&] { return packOnDevice(t).isOk(); });
  cudaMemcpy(back.data(), dst.ptr, total, cudaMemcpyDeviceToHost);
  const double g = gbps(total, ms);
  row("pack: conv SD->DS transpose, 4096 x [3][10240] bf16", back == want && g >= 0.6 * ceiling,
      fmt("%.1f GB/s", g) + fmt(" = %.2fx D2D", g / ceiling), ">= 0.6x D2D, bit-exact");
}

}  // namespace
}  // namespace hxfer::device

int main(int argc, char** argv) {
  using namespace hxfer::device;
  if (argc > 1 && std::strcmp(argv[1], "--ipc-child") == 0) return ipcChild(argc, argv);
  if (argc > 1 && std::strcmp(argv[1], "--fake-api") == 0) {
    // The engine rows over the fake device: their logic checked where there is no GPU.
    // Over ucx also through a 16 MiB staging region: 4 MiB windows of the part, two in flight.
    bool ok = true;
    for (const auto& [backend, staging] : {std::pair<const char*, uint64_t>{"cuda", 1ull << 30},
                                           {"ucx", 1ull << 30},
                                           {"ucx", 16ull << 20}}) {
      const ApiResult r = apiCheck(true, "nemotron-h-8b", 2500, backend, staging);
      std::printf(
          "fake api %s (staging %llu MiB): ran=%d exact=%d fence_held=%d packed=%d bytes=%llu "
          "%.3f ms %s\n",
          backend, static_cast<unsigned long long>(staging >> 20), r.ran, r.exact, r.fence_held,
          r.packed, static_cast<unsigned long long>(r.bytes), r.ms, r.why.c_str());
      ok = ok && r.ran && r.exact && r.fence_held && r.packed;
    }
    return ok ? 0 : 1;
  }
  if (argc == 5 && std::strcmp(argv[1], "--fake-across") == 0) {
    // Device pools behind ucx, one side per process (tests/hosts runs them on two hosts).
    return fakeAcross(argv[2], argv[3], static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10)));
  }
  if (argc > 1 && std::strcmp(argv[1], "--fake-ipc") == 0) {
    // The two-process rows over the fake device: their logic checked where there is no GPU.
    const IpcResult r = ipcCheck("fake", 64ull << 20);
    std::printf("fake ipc: ran=%d exact=%d fence_held=%d best=%.3f ms %s\n", r.ran, r.exact,
                r.fence_held, r.best_ms, r.why.c_str());
    return r.ran && r.exact && r.fence_held ? 0 : 1;
  }
  auto n = cudaDevices();
  if (!n.isOk()) {
    std::printf("hxfer-gpu-check: %s\n", n.status().toString().c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device 0 of %d: %s, sm_%d%d, %.0f GiB\n", *n, prop.name, prop.major, prop.minor,
              prop.totalGlobalMem / double(1ull << 30));
  const double ceiling = ceilingGbps(1ull << 30);
  row("D2D ceiling: one cudaMemcpy of 1 GiB", ceiling > 0, fmt("%.1f GB/s", ceiling));
  stormCheck(ceiling);
  packCheck(ceiling);
  constexpr uint64_t kIpcBytes = 1ull << 30;
  for (const char* kind : {"legacy", "vmm"}) {
    const IpcResult r = ipcCheck(kind, kIpcBytes);
    const std::string what =
        std::string("cuda transport, 2 processes, 1 GiB, ") +
        (std::strcmp(kind, "legacy") == 0 ? "cudaMalloc (legacy IPC)" : "VMM (posix fd)");
    if (!r.ran) {
      row(what, false, r.why.substr(0, 40), ">= 0.8x D2D, bytes exact");
      std::fprintf(stderr, "%s: %s\n", what.c_str(), r.why.c_str());
      continue;
    }
    const double g = gbps(kIpcBytes, r.best_ms);
    row(what, r.exact && g >= 0.8 * ceiling, fmt("%.1f GB/s", g) + fmt(" = %.2fx D2D", g / ceiling),
        ">= 0.8x D2D, bytes exact");
    row(std::string("fence: nothing moved before the event (") + kind + ")", r.fence_held,
        r.fence_held ? "held 100 ms, then landed" : "moved before the event");
  }
  for (const auto& [backend, staging] : {std::pair<const char*, uint64_t>{"cuda", 1ull << 30},
                                         {"ucx", 1ull << 30},
                                         {"ucx", 64ull << 20}}) {
    // The engine: Sender and Receiver over device pools, vllm (conv sd) to sglang (conv ds);
    // over cuda, and over ucx through pinned host memory (the path across hosts): the part
    // staged whole, and window by window through the default 64 MiB region.
    const ApiResult r = apiCheck(false, "nemotron-h-8b", 8192, backend, staging);
    const std::string what =
        std::string("one 8k-token nemotron-h-8b request, vllm -> sglang, API over ") + backend +
        (staging < (1ull << 30) ? ", 16 MiB windows, two in flight" : "");
    if (!r.ran) {
      row(what, false, r.why.substr(0, 40), "oracle exact");
      std::fprintf(stderr, "%s: %s\n", what.c_str(), r.why.c_str());
    } else {
      row(what, r.exact && r.packed,
          fmt("%.1f MB", r.bytes / 1e6) + fmt(" in %.2f ms", r.ms) +
              fmt(" = %.1f GB/s", gbps(r.bytes, r.ms)),
          "oracle exact, packed on the device");
      row(std::string("events (") + backend + (staging < (1ull << 30) ? ", windows" : "") +
              "): nothing landed while layers-ready/pages-free pended",
          r.fence_held, r.fence_held ? "held 100 ms, then landed" : "moved before the events");
      if (!r.exact) std::fprintf(stderr, "%s: %s\n", what.c_str(), r.why.c_str());
    }
  }
  int passed = 0, failed = 0;
  std::printf("\n%-66s %-6s %-40s %s\n", "check", "result", "figure", "target");
  for (const Row& r : rows) {
    const bool counted = r.figure.rfind("not built", 0) != 0;
    std::printf("%-66s %-6s %-40s %s\n", r.check.c_str(), counted ? (r.ok ? "PASS" : "FAIL") : "-",
                r.figure.c_str(), r.target.c_str());
    if (counted) (r.ok ? passed : failed)++;
  }
  std::printf("\n%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
