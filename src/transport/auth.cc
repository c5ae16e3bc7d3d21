#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/params.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

namespace hxfer::transport::auth {
namespace {

void appendLengthPrefixed(std::string& out, std::string_view part) {
  const uint32_t n = static_cast<uint32_t>(part.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(part);
}

// HMAC-SHA256 of `input` under `key` (an empty key is allowed: no token configured, the
// exchange then proves nothing).
std::array<uint8_t, 32> hmac(std::string_view key, std::span<const uint8_t> input) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  static const uint8_t kEmpty = 0;
  const void* k = key.empty() ? static_cast<const void*>(&kEmpty) : key.data();
  HMAC(EVP_sha256(), k, static_cast<int>(key.size()), input.data(), input.size(), out.data(), &len);
  return out;
}

std::string transcript(std::string_view label, const Nonce& connector_nonce,
                       const Nonce& listener_nonce, std::string_view binding) {
  std::string in(label);
  in.append(reinterpret_cast<const char*>(connector_nonce.data()), kNonceBytes);
  in.append(reinterpret_cast<const char*>(listener_nonce.data()), kNonceBytes);
  appendLengthPrefixed(in, binding);
  return in;
}

std::span<const uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

StatusOr<Nonce> randomNonce() {
  Nonce n;
  size_t got = 0;
  while (got < n.size()) {
    ssize_t r = getrandom(n.data() + got, n.size() - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Internal(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return n;
}

StatusOr<std::string> randomToken() {
  ASSIGN_OR_RETURN(const Nonce n, randomNonce());
  std::string out;
  for (uint8_t b : n) {
    out += "0123456789abcdef"[b >> 4];
    out += "0123456789abcdef"[b & 15];
  }
  return out;
}

std::string shmBinding(std::string_view listener_name, std::string_view connector_name) {
  std::string out = "shm";
  appendLengthPrefixed(out, listener_name);
  appendLengthPrefixed(out, connector_name);
  return out;
}

Proof prove(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::string_view binding) {
  const std::string_view label =
      role == Role::kListener ? "hxfer-auth-2 listener" : "hxfer-auth-2 connector";
  return hmac(token, bytes(transcript(label, connector_nonce, listener_nonce, binding)));
}

bool verify(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::string_view binding,
            std::span<const uint8_t> received) {
  if (received.size() != kProofBytes) return false;
  const Proof expected = prove(token, role, connector_nonce, listener_nonce, binding);
  return CRYPTO_memcmp(expected.data(), received.data(), kProofBytes) == 0;
}

SessionKeys sessionKeys(std::string_view token, Role self, const Nonce& connector_nonce,
                        const Nonce& listener_nonce, std::string_view binding) {
  const Key c = hmac(token, bytes(transcript("hxfer-session-2 connector", connector_nonce,
                                             listener_nonce, binding)));
  const Key l =
      hmac(token,
           bytes(transcript("hxfer-session-2 listener", connector_nonce, listener_nonce, binding)));
  return self == Role::kConnector ? SessionKeys{c, l} : SessionKeys{l, c};
}

namespace {

EVP_MAC* hmacAlgorithm() {
  // EVP_MAC (OpenSSL 3): the HMAC implementation is fetched once.
  static EVP_MAC* const kHmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  return kHmac;
}

// A context keyed with `key` for HMAC-SHA256; null on failure.
EVP_MAC_CTX* keyedContext(const Key& key) {
  EVP_MAC_CTX* ctx = hmacAlgorithm() ? EVP_MAC_CTX_new(hmacAlgorithm()) : nullptr;
  if (ctx == nullptr) return nullptr;
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                               OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(ctx, key.data(), key.size(), params) != 1) {
    EVP_MAC_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

void feedLength(EVP_MAC_CTX* ctx, size_t size) {
  const uint32_t n = static_cast<uint32_t>(size);
  uint8_t prefix[4];
  for (int i = 0; i < 4; ++i) prefix[i] = static_cast<uint8_t>((n >> (8 * i)) & 0xff);
  EVP_MAC_update(ctx, prefix, 4);
}

void feedBytes(EVP_MAC_CTX* ctx, std::span<const uint8_t> part) {
  if (!part.empty()) EVP_MAC_update(ctx, part.data(), part.size());
}

// fixed32 len(a) | a | fixed32 len(b) | b into a keyed context, then the truncated tag;
// nullopt if OpenSSL failed.
std::optional<Mac> macWith(EVP_MAC_CTX* ctx, std::initializer_list<std::span<const uint8_t>> a,
                           std::span<const uint8_t> b) {
  size_t a_size = 0;
  for (const auto& part : a) a_size += part.size();
  feedLength(ctx, a_size);
  for (const auto& part : a) feedBytes(ctx, part);
  feedLength(ctx, b.size());
  feedBytes(ctx, b);
  uint8_t full[32] = {};
  size_t len = 0;
  if (EVP_MAC_final(ctx, full, &len, sizeof(full)) != 1 || len != sizeof(full)) return std::nullopt;
  Mac out;
  std::memcpy(out.data(), full, kMacBytes);
  return out;
}

// A context per call when no keyed one is kept, so that callers share nothing. nullopt when
// OpenSSL failed (out of memory): a check then fails.
std::optional<Mac> macOnce(const Key& key, std::initializer_list<std::span<const uint8_t>> a,
                           std::span<const uint8_t> b) {
  EVP_MAC_CTX* ctx = keyedContext(key);
  if (ctx == nullptr) return std::nullopt;
  const std::optional<Mac> out = macWith(ctx, a, b);
  EVP_MAC_CTX_free(ctx);
  return out;
}

bool sameMac(const std::optional<Mac>& expected, std::span<const uint8_t> received) {
  return expected && received.size() == kMacBytes &&
         CRYPTO_memcmp(expected->data(), received.data(), kMacBytes) == 0;
}

}  // namespace

Mac mac(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return macOnce(key, {a}, b).value_or(Mac{});  // a zero tag, which no check accepts
}

MacKey::MacKey(const Key& key) : key_(key), keyed_(true), ctx_(keyedContext(key)) {
  // Re-initialising with a null key resets HMAC only from OpenSSL 3.0.3 on; before, it returns
  // success and leaves the finished state, so every tag after the first would be wrong. Two
  // tags through the kept context must match fresh ones, or each call keys its own.
  const uint8_t probe[] = {'h', 'x'};
  for (int i = 0; i < 2 && ctx_ != nullptr; ++i) {
    const std::optional<Mac> kept =
        EVP_MAC_init(ctx_, nullptr, 0, nullptr) == 1 ? macWith(ctx_, {probe}, {}) : std::nullopt;
    if (!kept || kept != macOnce(key_, {probe}, {})) {
      EVP_MAC_CTX_free(ctx_);
      ctx_ = nullptr;
    }
  }
}

MacKey::~MacKey() { EVP_MAC_CTX_free(ctx_); }

MacKey::MacKey(MacKey&& other) noexcept : key_(other.key_), keyed_(other.keyed_), ctx_(other.ctx_) {
  other.ctx_ = nullptr;
}

MacKey& MacKey::operator=(MacKey&& other) noexcept {
  if (this != &other) {
    EVP_MAC_CTX_free(ctx_);
    key_ = other.key_;
    keyed_ = other.keyed_;
    ctx_ = other.ctx_;
    other.ctx_ = nullptr;
  }
  return *this;
}

std::optional<Mac> MacKey::compute(std::initializer_list<std::span<const uint8_t>> a,
                                   std::span<const uint8_t> b) {
  if (!keyed_) return std::nullopt;  // no key: no tag, and no check passes
  // A null key re-initialises the context with the key it holds (HMAC's pads kept).
  if (ctx_ == nullptr || EVP_MAC_init(ctx_, nullptr, 0, nullptr) != 1) return macOnce(key_, a, b);
  return macWith(ctx_, a, b);
}

Mac MacKey::mac(std::initializer_list<std::span<const uint8_t>> a, std::span<const uint8_t> b) {
  return compute(a, b).value_or(Mac{});
}

bool MacKey::check(std::initializer_list<std::span<const uint8_t>> a, std::span<const uint8_t> b,
                   std::span<const uint8_t> received) {
  return sameMac(compute(a, b), received);
}

bool checkMac(const Key& key, std::span<const uint8_t> a, std::span<const uint8_t> b,
              std::span<const uint8_t> received) {
  return sameMac(macOnce(key, {a}, b), received);
}

}  // namespace hxfer::transport::auth
