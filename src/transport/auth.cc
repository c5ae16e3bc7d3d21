#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace hxfer::transport::auth {
namespace {

std::string_view label(Role role) {
  return role == Role::kListener ? "hxfer-auth-1 listener" : "hxfer-auth-1 connector";
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

Proof prove(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce) {
  const std::string_view l = label(role);
  uint8_t input[64 + 2 * kNonceBytes];
  std::memcpy(input, l.data(), l.size());
  std::memcpy(input + l.size(), connector_nonce.data(), kNonceBytes);
  std::memcpy(input + l.size() + kNonceBytes, listener_nonce.data(), kNonceBytes);
  Proof out{};
  unsigned int len = 0;
  // HMAC keys may be empty (no token configured): the exchange still runs and proves nothing.
  static const uint8_t kEmpty = 0;
  const void* key = token.empty() ? static_cast<const void*>(&kEmpty) : token.data();
  HMAC(EVP_sha256(), key, static_cast<int>(token.size()), input, l.size() + 2 * kNonceBytes,
       out.data(), &len);
  return out;
}

bool verify(std::string_view token, Role role, const Nonce& connector_nonce,
            const Nonce& listener_nonce, std::span<const uint8_t> received) {
  if (received.size() != kProofBytes) return false;
  const Proof expected = prove(token, role, connector_nonce, listener_nonce);
  return CRYPTO_memcmp(expected.data(), received.data(), kProofBytes) == 0;
}

}  // namespace hxfer::transport::auth
