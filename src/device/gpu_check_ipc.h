// hxfer-gpu-check's two-process rows (gpu_check_ipc.cc): the cuda transport over CudaDevice
// between this process and a child it spawns from its own executable.
#pragma once

#include <cstdint>
#include <string>

namespace hxfer::device {

struct IpcResult {
  bool ran = false;    // the child wrote and reported; the figures below are real
  bool exact = false;  // every byte of the destination is what the child wrote last
  // The fenced write had not finished 100 ms after it was posted, before its event, and the
  // destination then still held every byte of the earlier writes and none of it.
  bool fence_held = false;
  double best_ms = 0;  // best of 5 writes of the whole region, posted to done
  std::string why;     // what went wrong when !ran
};

// Allocates `bytes` of `kind` ("legacy": cudaMalloc; "vmm": cuMemCreate exportable as a POSIX
// fd; "fake": FakeDevice memory, no GPU needed) as a cuda agent's writable region, spawns the
// child, and checks what it wrote.
IpcResult ipcCheck(const std::string& kind, uint64_t bytes);

// The child's side (argv: --ipc-child ADDRESS KIND BYTES); its exit code.
int ipcChild(int argc, char** argv);

}  // namespace hxfer::device
