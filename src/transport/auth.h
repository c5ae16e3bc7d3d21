// Peer authentication shared by the shm and ucx transports (docs/reliability.md, "Threat
// model"). Before any region, fd, key or message crosses a connection, both ends prove that
// they hold the same token without sending it, bound to the connection they run on:
//
//   connector -> listener  hello      {version, nonce_c}
//   listener  -> connector challenge  {version, nonce_l, proof_l}
//   connector -> listener  proof      {proof_c}
//   listener  -> connector welcome    {}            (or refused {reason}, then close)
//
//   proof_l = HMAC-SHA256(token, "hxfer-auth-2 listener"  | nonce_c | nonce_l | binding)
//   proof_c = HMAC-SHA256(token, "hxfer-auth-2 connector" | nonce_c | nonce_l | binding)
//   binding = fixed32 length | bytes: what both ends see of the channel itself
//
// Fresh 32-byte nonces on both sides make every proof single-use (a replayed hello or proof
// fails against the new nonce), the role labels stop a proof being reflected back, and the
// listener's proof comes first so a connector never hands its regions to a squatter on the
// address. The binding stops a relay: a process that forwards the hello, challenge and proof
// between a connector and the real listener (or reflects them off the connector's own
// listener) sits on two connections, and the two ends of each see different channel
// identities, so neither proof verifies. shm binds the socket names the kernel reports for
// both ends (shmBinding); ucx, where addresses change on the way (NAT, advertised addresses),
// binds nothing here and authenticates everything after the welcome with session keys derived
// from the exchange (sessionKeys, mac), which a relay never learns. Proofs and MACs are
// compared in constant time. An empty token still runs the exchange (it then proves nothing;
// the agent logs a warning and counts it) and same-host transports also check the peer's uid.
//
// Pure functions, thread-safe; a MacKey serves one caller at a time.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

struct evp_mac_ctx_st;  // OpenSSL's EVP_MAC_CTX

namespace hxfer::transport::auth {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;
inline constexpr size_t kKeyBytes = 32;
inline constexpr size_t kMacBytes = 16;  // HMAC-SHA256 truncated (RFC 2104 §5)
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;
using Key = std::array<uint8_t, kKeyBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

enum class Role { kListener, kConnector };

// A nonce from the kernel's CSPRNG (getrandom). Internal error only if the kernel refuses.
StatusOr<Nonce> randomNonce();

// A fresh random token (64 hex characters) for a set of processes started together (the demo,
// the benchmarks), so that no other process can join them.
StatusOr<std::string> randomToken();

// The shm channel binding: the listening socket's name and the connecting socket's name (each
// as the kernel reports it: getsockname / getpeername, abstract names with their leading NUL;
// empty for an unbound connecting socket), each length-prefixed.
std::string shmBinding(std::string_view listener_name, std::string_view connector_name);

// The proof that `role` holds `token` for this exchange on the channel `binding`.
Proof prove(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::string_view binding);

// Constant-time check of `received` against the expected proof; false when sizes differ.
bool verify(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::string_view binding,
            std::span<const uint8_t> received);

// The keys of one authenticated connection, one per direction:
//   key(dir) = HMAC-SHA256(token, "hxfer-session-2 " + dir | nonce_c | nonce_l | binding)
// with dir "connector" for what the connector sends and "listener" for what the listener sends.
struct SessionKeys {
  Key send;
  Key receive;
};
SessionKeys sessionKeys(std::string_view token, Role self, const Nonce& connector_nonce,
                        const Nonce& listener_nonce, std::string_view binding);

// HMAC-SHA256(key, fixed32 len(a) | a | fixed32 len(b) | b), truncated to kMacBytes.
Mac mac(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b = {});
// Constant-time check of `received` (kMacBytes) against mac(key, a, b).
bool checkMac(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b,
              std::span<const uint8_t> received);

// mac and checkMac under one key whose HMAC set-up (the digest fetched, the key's inner and
// outer pads hashed) is done once, for a connection's data path, which MACs every message,
// write and ack under its session keys: about a quarter of mac's cost per call. `a` is given in
// parts, MACed as their concatenation (a header after its id byte, without joining them).
// Not thread-safe: one caller at a time (ucx: whoever drives the worker).
class MacKey {
 public:
  MacKey() = default;  // no key: mac gives a zero tag and check fails
  explicit MacKey(const Key& key);
  ~MacKey();
  MacKey(MacKey&& other) noexcept;
  MacKey& operator=(MacKey&& other) noexcept;
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;

  // mac(key, a[0] | a[1] | ..., b).
  Mac mac(std::initializer_list<std::span<const uint8_t>> a, std::span<const uint8_t> b = {});
  // Constant-time check of `received` (kMacBytes) against mac(a, b).
  bool check(std::initializer_list<std::span<const uint8_t>> a, std::span<const uint8_t> b,
             std::span<const uint8_t> received);

 private:
  std::optional<Mac> compute(std::initializer_list<std::span<const uint8_t>> a,
                             std::span<const uint8_t> b);
  Key key_{};
  bool keyed_ = false;
  // The keyed context, re-initialised per call; null if OpenSSL could not make one, and then
  // each call sets the key up itself, as mac() does.
  evp_mac_ctx_st* ctx_ = nullptr;
};

}  // namespace hxfer::transport::auth
