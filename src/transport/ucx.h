// The ucx backend (across hosts): one UCP worker per agent driven by an internal progress
// thread, a listener on ip:port, active messages for control, and data moved either by
// ucp_put_nbx + ucp_ep_flush_nbx (real RMA lanes) or by active-message rendezvous received
// straight into the destination region, validated by the receiver against its own regions.
// Every connection first runs the handshake of transport/auth.h over active messages; until a
// peer proved it holds our token nothing else of it is read (dropped, endpoint closed), and
// only kRemoteWritable regions ever take an incoming write. Unauthenticated endpoints, the
// reorder buffer and half-received transfers are bounded per agent / per peer (AgentStats).
// See transport.h for the contract and docs/transport.md for the message formats and bounds.
// Thread-safety: as Agent (transport.h). All UCX calls happen on the progress thread.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace hxfer::transport {

StatusOr<std::unique_ptr<Agent>> createUcxAgent(const AgentConfig& config);

}  // namespace hxfer::transport
