// The shm backend (same host, the fast path): regions are memfd-backed; each agent listens on
// an abstract Unix-domain socket that carries length-prefixed control frames and, with
// SCM_RIGHTS, the fds of every registered region. A peer maps those fds once; a write is one
// memcpy on the writer's copy thread straight into the peer's pool. Wire framing and the
// connection protocol are described in docs/transport.md.
// Thread-safety: as Agent (transport.h).
#pragma once

#include <memory>

#include "transport/transport.h"

namespace hxfer::transport {

StatusOr<std::unique_ptr<Agent>> createShmAgent(const AgentConfig& config);

}  // namespace hxfer::transport
