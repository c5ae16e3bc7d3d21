// Peer authentication shared by the shm and ucx transports (docs/reliability.md, "Threat
// model"). Before any region, fd, key or message crosses a connection, both ends prove that
// they hold the same token without sending it:
//
//   connector -> listener  hello      {version, nonce_c}
//   listener  -> connector challenge  {version, nonce_l, proof_l}
//   connector -> listener  proof      {proof_c}
//   listener  -> connector welcome    {}            (or refused {reason}, then close)
//
//   proof_l = HMAC-SHA256(token, "hxfer-auth-1 listener"  | nonce_c | nonce_l)
//   proof_c = HMAC-SHA256(token, "hxfer-auth-1 connector" | nonce_c | nonce_l)
//
// Fresh 32-byte nonces on both sides make every proof single-use (a replayed hello or proof
// fails against the new nonce), the role labels stop a proof being reflected back, and the
// listener's proof comes first so a connector never hands its regions to a squatter on the
// address. Proofs are compared in constant time. An empty token still runs the exchange (it
// then proves nothing; the agent logs a warning and counts it) and same-host transports also
// check the peer's uid.
//
// Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"

namespace hxfer::transport::auth {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

enum class Role { kListener, kConnector };

// A nonce from the kernel's CSPRNG (getrandom). Internal error only if the kernel refuses.
StatusOr<Nonce> randomNonce();

// A fresh random token (64 hex characters) for a set of processes started together (the demo,
// the benchmarks), so that no other process can join them.
StatusOr<std::string> randomToken();

// The proof that `role` holds `token` for this exchange.
Proof prove(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce);

// Constant-time check of `received` against the expected proof; false when sizes differ.
bool verify(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::span<const uint8_t> received);

}  // namespace hxfer::transport::auth
