// A Stream whose work runs in order on a host thread of its own: the fake device's streams (a
// copy or pack is the host emulation of its launch) and the CUDA device's (each a launch on a
// CUDA stream that the thread waits for). Events are ManualEvents the thread signals; waitFor
// waits for any Event on that thread (an engine's, another stream's), so work behind it starts
// only after it. Destroying the stream cancels what has not started (Cancelled).
#pragma once

#include <functional>
#include <memory>

#include "device/device_api.h"

namespace hxfer::device {

struct StreamOps {
  std::function<Status(const HostCopyTable&)> copy;
  std::function<Status(const HostPackTable&)> pack;
  // Run first in the stream's thread (a CUDA device made current, its stream created); an
  // error fails every op of the stream with it.
  std::function<Status()> on_start;
  // Run after the thread ended (the CUDA stream destroyed).
  std::function<void()> on_stop;
};

std::unique_ptr<Stream> makeWorkerStream(StreamOps ops);

}  // namespace hxfer::device
