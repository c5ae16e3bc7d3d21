#include "transport/auth.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <span>
#include <vector>

namespace hxfer::transport::auth {
namespace {

const std::string kChannel = shmBinding(std::string("\0hxfer-ctx", 10), std::string("\0abcde", 6));

TEST(Auth, ProofVerifiesOnlyForTheSameTokenRoleNoncesAndChannel) {
  auto c = randomNonce();
  auto l = randomNonce();
  ASSERT_TRUE(c.isOk() && l.isOk());
  const Proof p = prove("secret", Role::kListener, *c, *l, kChannel);
  EXPECT_TRUE(verify("secret", Role::kListener, *c, *l, kChannel, p));
  EXPECT_FALSE(verify("secreT", Role::kListener, *c, *l, kChannel, p));
  EXPECT_FALSE(verify("", Role::kListener, *c, *l, kChannel, p));
  // A listener's proof reflected back as the connector's does not verify.
  EXPECT_FALSE(verify("secret", Role::kConnector, *c, *l, kChannel, p));
  // Replayed against a fresh listener nonce it does not verify.
  auto l2 = randomNonce();
  ASSERT_TRUE(l2.isOk());
  EXPECT_FALSE(verify("secret", Role::kListener, *c, *l2, kChannel, p));
  // Swapped nonces do not verify.
  EXPECT_FALSE(verify("secret", Role::kListener, *l, *c, kChannel, p));
  // Relayed: the relay's connection to the listener is another channel than the connector's
  // connection to the relay, so a proof made on one does not verify on the other.
  const std::string relayed =
      shmBinding(std::string("\0hxfer-relay", 12), std::string("\0abcde", 6));
  EXPECT_FALSE(verify("secret", Role::kListener, *c, *l, relayed, p));
  EXPECT_FALSE(
      verify("secret", Role::kListener, *c, *l, shmBinding(std::string("\0hxfer-ctx", 10), ""), p));
}

TEST(Auth, TruncatedOrFlippedProofIsRefused) {
  Nonce c{}, l{};
  c[0] = 1;
  l[0] = 2;
  Proof p = prove("t", Role::kConnector, c, l, kChannel);
  EXPECT_FALSE(
      verify("t", Role::kConnector, c, l, kChannel, std::span<const uint8_t>(p.data(), 31)));
  for (size_t i = 0; i < p.size(); ++i) {
    Proof q = p;
    q[i] ^= 0x01;
    EXPECT_FALSE(verify("t", Role::kConnector, c, l, kChannel, q)) << "byte " << i;
  }
}

TEST(Auth, NoncesDiffer) {
  auto a = randomNonce();
  auto b = randomNonce();
  ASSERT_TRUE(a.isOk() && b.isOk());
  EXPECT_NE(*a, *b);
}

std::string hex(std::span<const uint8_t> b) {
  std::string out;
  char two[3];
  for (uint8_t x : b) {
    std::snprintf(two, sizeof(two), "%02x", x);
    out += two;
  }
  return out;
}

TEST(Auth, ProofIsHmacSha256OfLabelNoncesAndLengthPrefixedBinding) {
  // Computed independently (Python's hmac): HMAC-SHA256(key "Jefe", "hxfer-auth-2 listener" +
  // 64 zero bytes + fixed32 0), the empty binding.
  const Nonce zero{};
  EXPECT_EQ(hex(prove("Jefe", Role::kListener, zero, zero, "")),
            "31f25db913d9560926663d1033997dbf34b18c77e1c33ac07407c48354ec9b06");
}

// One exchange of fresh nonces under token "secret": both ends' session keys.
struct Exchange {
  Nonce c{};
  Nonce l{};
  SessionKeys conn;
  SessionKeys lis;
};
Exchange freshExchange() {
  auto c = randomNonce();
  auto l = randomNonce();
  EXPECT_TRUE(c.isOk() && l.isOk());
  Exchange x;
  if (c.isOk()) x.c = *c;
  if (l.isOk()) x.l = *l;
  x.conn = sessionKeys("secret", Role::kConnector, x.c, x.l, "");
  x.lis = sessionKeys("secret", Role::kListener, x.c, x.l, "");
  return x;
}

TEST(Auth, SessionKeysPairUpAcrossTheTwoEndsAndMacsCoverBothParts) {
  const auto [c, l, conn, lis] = freshExchange();
  EXPECT_EQ(conn.send, lis.receive);
  EXPECT_EQ(conn.receive, lis.send);
  EXPECT_NE(conn.send, conn.receive);
  EXPECT_NE(sessionKeys("other", Role::kConnector, c, l, "").send, conn.send);
  const uint8_t header[] = {1, 2, 3};
  const uint8_t data[] = {4, 5};
  const Mac m = mac(conn.send, header, data);
  EXPECT_TRUE(checkMac(lis.receive, header, data, m));
  EXPECT_FALSE(checkMac(lis.send, header, data, m));
  EXPECT_FALSE(checkMac(lis.receive, header, {}, m));
  // The parts are length-prefixed: moving a byte from one to the other changes the MAC.
  const uint8_t header4[] = {1, 2, 3, 4};
  const uint8_t data1[] = {5};
  EXPECT_NE(mac(conn.send, header4, data1), mac(conn.send, header, data));
  Mac flipped = m;
  flipped[15] ^= 1;
  EXPECT_FALSE(checkMac(lis.receive, header, data, flipped));
}

// A MacKey gives mac()'s tag call after call (its keyed context re-initialised each time),
// with `a` in parts MACed as their concatenation, and checks as checkMac does.
TEST(Auth, AKeptMacKeyAgreesWithMacCallAfterCall) {
  const auto [c, l, conn, lis] = freshExchange();
  MacKey send(conn.send);
  MacKey receive(lis.receive);
  for (uint8_t i = 0; i < 5; ++i) {
    const uint8_t id = 4;
    const uint8_t fields[] = {i, 2, 3, 4, 5, 6};
    const uint8_t joined[] = {id, i, 2, 3, 4, 5, 6};
    const std::vector<uint8_t> data(i * 100u, i);
    const Mac m = send.mac({{&id, 1}, fields}, data);
    EXPECT_EQ(m, mac(conn.send, joined, data)) << "call " << int(i);
    EXPECT_TRUE(receive.check({joined}, data, m)) << "call " << int(i);
    EXPECT_TRUE(checkMac(lis.receive, joined, data, m));
    Mac flipped = m;
    flipped[i % kMacBytes] ^= 0x40;
    EXPECT_FALSE(receive.check({{&id, 1}, fields}, data, flipped));
    EXPECT_FALSE(receive.check({{&id, 1}, fields}, data, std::span<const uint8_t>(m).first(15)));
    // The other direction's key, or the bytes moved between the two parts, do not check out.
    EXPECT_FALSE(MacKey(lis.send).check({joined}, data, m));
    if (!data.empty()) {
      const std::span<const uint8_t> d(data);
      EXPECT_FALSE(receive.check({joined, d.first(1)}, d.subspan(1), m));
    }
  }
  // Moved: the new owner MACs under the same key.
  MacKey moved = std::move(send);
  const uint8_t one[] = {9};
  EXPECT_EQ(moved.mac({one}), mac(conn.send, one));
  // No key: nothing checks out, not even a tag made under the all-zero key.
  MacKey none;
  EXPECT_FALSE(none.check({one}, {}, mac(Key{}, one)));
  EXPECT_EQ(none.mac({one}), Mac{});
}

}  // namespace
}  // namespace hxfer::transport::auth
