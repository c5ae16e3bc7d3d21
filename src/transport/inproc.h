// The inproc backend: peers are agents in the same process, found through a process-local
// registry by their listen name; a write is a memcpy on the writer's copy thread straight into
// the peer's registered region. For unit tests and single-process runs.
// Thread-safety: as Agent (transport.h).
#pragma once

#include <memory>

#include "transport/transport.h"

namespace hxfer::transport {

StatusOr<std::unique_ptr<Agent>> createInprocAgent(const AgentConfig& config);

}  // namespace hxfer::transport
