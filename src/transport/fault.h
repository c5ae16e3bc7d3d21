// Fault-injection decorator over any Agent, for reliability tests of the engine: fail the Nth
// write, fail writes at random, delay writes, drop or delay control messages, and close a peer
// abruptly after N writes. All choices come from a seeded policy, so a failing run replays.
//
// The decorator forwards everything else unchanged; capabilities().name is "fault(<inner>)".
// Thread-safety: as Agent (every method thread-safe). Delays run on an internal thread, so
// postWrite / sendMessage never block for them.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "transport/transport.h"

namespace hxfer::transport {

struct FaultPolicy {
  uint64_t seed = 1;
  // Writes (postWrite calls) are numbered from 1 per agent. The Nth one fails with
  // `fail_status` without moving a byte; 0 disables.
  uint64_t fail_nth_write = 0;
  double fail_write_probability = 0.0;
  Status fail_status = Unavailable("injected fault: write failed");
  // Every successful write completes no earlier than this after it was posted.
  std::chrono::milliseconds write_delay{0};
  // Messages (sendMessage calls) are numbered from 1 per agent. The Nth is silently dropped;
  // 0 disables.
  uint64_t drop_nth_message = 0;
  double drop_message_probability = 0.0;
  // The Nth message is not sent and sendMessage returns Unavailable, as a send to a peer that
  // closed before its loss was seen; 0 disables.
  uint64_t fail_nth_message = 0;
  // Every message is sent this much later (order per peer is kept).
  std::chrono::milliseconds message_delay{0};
  // After this many writes to one peer, the peer is disconnected abruptly (the write that
  // reaches the count is posted, then the peer closed); 0 disables.
  uint64_t close_peer_after_writes = 0;
  // connect() calls are numbered from 1 per agent. The Nth one connects, closes the connection
  // and returns the (dead) peer id: a peer that went away right after accepting. 0 disables.
  uint64_t close_nth_connect = 0;
  // grantWrites() calls are numbered from 1 per agent. The Nth disconnects its peer before it
  // is forwarded: a peer lost between its hello and its grant. 0 disables.
  uint64_t close_nth_grant = 0;
};

// Counters of what the decorator did, for test assertions.
struct FaultStats {
  uint64_t writes_failed = 0;
  uint64_t writes_delayed = 0;
  uint64_t messages_dropped = 0;
  uint64_t messages_failed = 0;
  uint64_t messages_delayed = 0;
  uint64_t peers_closed = 0;  // by close_peer_after_writes, close_nth_connect or close_nth_grant
};

// Wraps `inner`. The returned agent owns it.
std::unique_ptr<Agent> wrapWithFaults(std::unique_ptr<Agent> inner, FaultPolicy policy);
// The stats of an agent returned by wrapWithFaults (NotFound-like zero stats for others).
FaultStats faultStats(const Agent& agent);

}  // namespace hxfer::transport
