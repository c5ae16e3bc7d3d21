#include "transport/auth.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace hxfer::transport::auth {
namespace {

TEST(Auth, ProofVerifiesOnlyForTheSameTokenRoleAndNonces) {
  auto c = randomNonce();
  auto l = randomNonce();
  ASSERT_TRUE(c.isOk() && l.isOk());
  const Proof p = prove("secret", Role::kListener, *c, *l);
  EXPECT_TRUE(verify("secret", Role::kListener, *c, *l, p));
  EXPECT_FALSE(verify("secreT", Role::kListener, *c, *l, p));
  EXPECT_FALSE(verify("", Role::kListener, *c, *l, p));
  // A listener's proof reflected back as the connector's does not verify.
  EXPECT_FALSE(verify("secret", Role::kConnector, *c, *l, p));
  // Replayed against a fresh listener nonce it does not verify.
  auto l2 = randomNonce();
  ASSERT_TRUE(l2.isOk());
  EXPECT_FALSE(verify("secret", Role::kListener, *c, *l2, p));
  // Swapped nonces do not verify.
  EXPECT_FALSE(verify("secret", Role::kListener, *l, *c, p));
}

TEST(Auth, TruncatedOrFlippedProofIsRefused) {
  Nonce c{}, l{};
  c[0] = 1;
  l[0] = 2;
  Proof p = prove("t", Role::kConnector, c, l);
  EXPECT_FALSE(verify("t", Role::kConnector, c, l, std::span<const uint8_t>(p.data(), 31)));
  for (size_t i = 0; i < p.size(); ++i) {
    Proof q = p;
    q[i] ^= 0x01;
    EXPECT_FALSE(verify("t", Role::kConnector, c, l, q)) << "byte " << i;
  }
}

TEST(Auth, NoncesDiffer) {
  auto a = randomNonce();
  auto b = randomNonce();
  ASSERT_TRUE(a.isOk() && b.isOk());
  EXPECT_NE(*a, *b);
}

TEST(Auth, ProofIsHmacSha256OfLabelAndNonces) {
  // Computed independently: HMAC-SHA256(key "Jefe", "hxfer-auth-1 listener" + 64 zero bytes).
  const Nonce zero{};
  const Proof p = prove("Jefe", Role::kListener, zero, zero);
  char hex[2 * kProofBytes + 1];
  for (size_t i = 0; i < p.size(); ++i) std::snprintf(hex + 2 * i, 3, "%02x", p[i]);
  EXPECT_STREQ(hex, "3d45272b54873c2e200b2841e1a04d06baa1aec1f23aa628160e47cce2165a8c");
}

}  // namespace
}  // namespace hxfer::transport::auth
