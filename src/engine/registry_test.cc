// Discovery through etcd against a real etcd (Debian's etcd-server, started per test on
// loopback ports with a data directory of its own): registration under a lease, lookup by
// instance, a restart's new incarnation, lease loss and re-registration, an unreachable etcd,
// and values a hostile or broken writer could leave.
#include "engine/registry.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace hxfer::engine {
namespace {

using namespace std::chrono_literals;

std::string newIncarnation() {
  static uint64_t next = 0x1234;
  return incarnationText(next++ * 0x9e3779b97f4a7c15ull);
}

uint16_t freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// One etcd on 127.0.0.1, killed with the test.
class Etcd {
 public:
  Etcd()
      : dir_(std::filesystem::temp_directory_path() /
             ("hxfer-etcd-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++))) {
    std::filesystem::remove_all(dir_);
    port_ = freePort();
    start();
  }
  ~Etcd() {
    stop();
    std::filesystem::remove_all(dir_);
  }
  static bool installed() { return ::access(kBinary, X_OK) == 0; }
  std::string url() const { return "etcd://127.0.0.1:" + std::to_string(port_); }

  void start() {
    const std::string client = "http://127.0.0.1:" + std::to_string(port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(freePort());
    std::vector<std::string> args = {kBinary,
                                     "--data-dir",
                                     dir_.string(),
                                     "--listen-client-urls",
                                     client,
                                     "--advertise-client-urls",
                                     client,
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     "default=" + peer,
                                     "--logger",
                                     "zap",
                                     "--log-level",
                                     "error"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ASSERT_EQ(::posix_spawn(&pid_, kBinary, nullptr, nullptr, argv.data(), environ), 0);
    auto c = EtcdClient::create(url(), 1s);
    ASSERT_TRUE(c.isOk());
    for (int i = 0; i < 200; ++i) {
      if ((*c)->range("probe").isOk()) return;
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "etcd did not answer on " << url();
  }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  static constexpr const char* kBinary = "/usr/bin/etcd";
  static inline int counter_ = 0;
  std::filesystem::path dir_;
  uint16_t port_ = 0;
  pid_t pid_ = -1;
};

RankRecord record(std::string instance, uint32_t rank, uint32_t tp, std::string address) {
  RankRecord r;
  r.instance = std::move(instance);
  r.role = "context";
  r.rank = rank;
  r.tp = tp;
  r.address = std::move(address);
  r.incarnation = newIncarnation();
  r.routing = "backend ucx";
  return r;
}

TEST(RegistryRecord, RoundTripsAndRefusesBrokenValuesNamingTheField) {
  RankRecord r = record("ctx", 1, 2, "ucx:10.0.0.1:7000");
  auto back = RankRecord::fromJson(r.toJson(), r.key());
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(*back, r);
  EXPECT_EQ(r.key(), "hxfer/ctx/context/1");
  EXPECT_EQ(r.incarnation.size(), 16u);
  EXPECT_NE(r.incarnation, newIncarnation());

  struct Case {
    std::string json, what;
  };
  const std::vector<Case> bad = {
      {"not json", "not a JSON object"},
      {"[1]", "not a JSON object"},
      {R"({"instance":"ctx","role":"context","address":"a","rank":1,"tp":2,"pp":1})",
       "'incarnation'"},
      {R"({"instance":"ctx","role":"context","address":"","incarnation":"x","rank":1,"tp":2,"pp":1})",
       "'address'"},
      {R"({"instance":"ctx","role":"context","address":"a","incarnation":"x","rank":-1,"tp":2,"pp":1})",
       "'rank'"},
      {R"({"instance":"ctx","role":"context","address":"a","incarnation":"x","rank":2,"tp":2,"pp":1})",
       "does not fit tp=2"},
      {R"({"instance":"ctx","role":"context","address":"a","incarnation":"x","rank":1,"tp":0,"pp":1})",
       "does not fit"},
      {R"({"instance":"other","role":"context","address":"a","incarnation":"x","rank":1,"tp":2,"pp":1})",
       "not the key"},
      // Each count in range, their product 4.3e9 ranks (a reader once walked them all).
      {R"({"instance":"ctx","role":"context","address":"a","incarnation":"x","rank":1,"tp":65535,"pp":65535})",
       "tp=65535 pp=65535 make 4294836225 ranks, more than an instance may have (65536)"},
      {R"({"instance":"ctx","role":"context","address":"a","incarnation":"x","rank":1,"tp":65536,"pp":65536})",
       "make 4294967296 ranks"},
  };
  for (const Case& c : bad) {
    auto got = RankRecord::fromJson(c.json, "hxfer/ctx/context/1");
    ASSERT_FALSE(got.isOk()) << c.json;
    EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << c.json;
    EXPECT_NE(got.status().message().find(c.what), std::string::npos) << got.status().toString();
    EXPECT_NE(got.status().message().find("hxfer/ctx/context/1"), std::string::npos);
  }
}

TEST(RegistryClient, RefusesAUrlThatIsNotEtcdHostPort) {
  for (const char* url :
       {"", "127.0.0.1:2379", "etcd://", "etcd://host", "ftp://h:1", "etcd://h:1/path"}) {
    auto c = EtcdClient::create(url, 1s);
    ASSERT_FALSE(c.isOk()) << url;
    EXPECT_NE(c.status().message().find("etcd://HOST:PORT"), std::string::npos);
  }
  EXPECT_TRUE(EtcdClient::create("etcd://127.0.0.1:2379", 1s).isOk());
  EXPECT_TRUE(EtcdClient::create("http://127.0.0.1:2379/", 1s).isOk());
}

TEST(RegistryClient, UnreachableEtcdIsUnavailableNamingIt) {
  auto c = EtcdClient::create("etcd://127.0.0.1:" + std::to_string(freePort()), 500ms);
  ASSERT_TRUE(c.isOk());
  auto r = (*c)->range("hxfer/");
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find((*c)->url()), std::string::npos) << r.status().toString();
  EXPECT_FALSE(Registration::start(*c, record("x", 0, 1, "a"), 5).isOk());
}

// A proxy in front of etcd answering 503 with text (as during an etcd restart): unreachable,
// so a discovering rank waits instead of giving up on a broken registry.
TEST(RegistryClient, ATextErrorReplyIsUnavailableNotCorruption) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread proxy([fd] {
    const int c = ::accept(fd, nullptr, nullptr);
    char buf[4096];
    (void)!::recv(c, buf, sizeof(buf), 0);
    const std::string reply =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 12\r\nConnection: close\r\n\r\n"
        "no upstream\n";
    (void)!::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
    ::close(c);
  });
  auto c = EtcdClient::create("etcd://127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 5s);
  ASSERT_TRUE(c.isOk());
  auto r = (*c)->range("hxfer/");
  proxy.join();
  ::close(fd);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().toString();
  EXPECT_NE(r.status().message().find("HTTP 503"), std::string::npos) << r.status().toString();
}

class RegistryLive : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Etcd::installed())
        << "/usr/bin/etcd missing: install etcd-server (scripts/install-deps.sh does)";
    etcd_ = std::make_unique<Etcd>();
    auto c = EtcdClient::create(etcd_->url(), 2s);
    ASSERT_TRUE(c.isOk());
    client_ = *c;
  }
  std::unique_ptr<Etcd> etcd_;
  std::shared_ptr<EtcdClient> client_;
};

TEST_F(RegistryLive, AnInstanceIsFoundOnceEveryRankRegisteredAndLeavesWithItsRanks) {
  auto none = findInstance(*client_, "ctx", "context");
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().toString();
  auto r0 = Registration::start(client_, record("ctx", 0, 2, "ucx:10.0.0.1:7000"), 3);
  ASSERT_TRUE(r0.isOk()) << r0.status().toString();
  auto half = findInstance(*client_, "ctx", "context");
  EXPECT_EQ(half.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(half.status().message().find("1 of 2 context ranks registered (missing 1)"),
            std::string::npos)
      << half.status().toString();
  const RankRecord one = record("ctx", 1, 2, "ucx:10.0.0.1:7001");
  auto r1 = Registration::start(client_, one, 3);
  ASSERT_TRUE(r1.isOk());
  // Another instance and another role under the same root do not count.
  auto other = Registration::start(client_, record("ctx2", 0, 1, "ucx:10.0.0.9:1"), 3);
  ASSERT_TRUE(other.isOk());
  auto all = findInstance(*client_, "ctx", "context");
  ASSERT_TRUE(all.isOk()) << all.status().toString();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].address, "ucx:10.0.0.1:7000");
  EXPECT_EQ((*all)[1], one);

  // Alive past several ttls: the keep-alive works.
  std::this_thread::sleep_for(4s);
  EXPECT_TRUE(findInstance(*client_, "ctx", "context").isOk());
  EXPECT_TRUE((*r0)->reachable());
  EXPECT_EQ((*r0)->errors(), 0u);

  // A rank that stops unregisters (its lease is revoked): the instance is incomplete again.
  r1->reset();
  auto gone = findInstance(*client_, "ctx", "context");
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status().toString();

  // A restart registers a new incarnation under the same key: readers see the change.
  RankRecord restarted = one;
  restarted.incarnation = newIncarnation();
  restarted.address = "ucx:10.0.0.1:7002";
  auto r1b = Registration::start(client_, restarted, 3);
  ASSERT_TRUE(r1b.isOk());
  all = findInstance(*client_, "ctx", "context");
  ASSERT_TRUE(all.isOk());
  EXPECT_NE((*all)[1].incarnation, one.incarnation);
  EXPECT_EQ((*all)[1].address, "ucx:10.0.0.1:7002");
}

// A process that hung past its lease while a restart took its rank comes back: its
// keep-alive finds the lease gone, and it must not write its stale record over the new one
// (peers would reconnect to it, and its exit would delete the key for good).
TEST_F(RegistryLive, AProcessBackAfterItsLeaseExpiredNeverOverwritesItsReplacement) {
  const RankRecord old = record("ctx", 0, 1, "ucx:10.0.0.1:7000");
  auto stale = Registration::start(client_, old, 2);
  ASSERT_TRUE(stale.isOk()) << stale.status().toString();
  RankRecord restarted = old;
  restarted.incarnation = newIncarnation();
  restarted.address = "ucx:10.0.0.1:7001";
  auto fresh = Registration::start(client_, restarted, 30);  // the restart overwrites
  ASSERT_TRUE(fresh.isOk()) << fresh.status().toString();
  ASSERT_TRUE(client_->revoke((*stale)->lease()).isOk());  // the hang outlived the old lease
  for (int i = 0; i < 100 && !(*stale)->superseded(); ++i) std::this_thread::sleep_for(50ms);
  EXPECT_TRUE((*stale)->superseded());
  EXPECT_EQ((*stale)->reregistered(), 0u);
  auto found = findInstance(*client_, "ctx", "context");
  ASSERT_TRUE(found.isOk()) << found.status().toString();
  EXPECT_EQ((*found)[0], restarted);
  stale->reset();  // its exit revokes only its own lease
  found = findInstance(*client_, "ctx", "context");
  ASSERT_TRUE(found.isOk()) << found.status().toString();
  EXPECT_EQ((*found)[0], restarted);
  EXPECT_FALSE((*fresh)->superseded());

  // With its key gone instead (nobody took the rank), it registers again.
  const RankRecord alone = record("solo", 0, 1, "ucx:10.0.0.1:7100");
  auto back = Registration::start(client_, alone, 2);
  ASSERT_TRUE(back.isOk());
  ASSERT_TRUE(client_->revoke((*back)->lease()).isOk());
  for (int i = 0; i < 100 && (*back)->reregistered() == 0; ++i) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ((*back)->reregistered(), 1u);
  EXPECT_FALSE((*back)->superseded());
  found = findInstance(*client_, "solo", "context");
  ASSERT_TRUE(found.isOk()) << found.status().toString();
  EXPECT_EQ((*found)[0], alone);
}

// The prefix hxfer/a/context/ also matches the keys of an instance named "a/context/x": they
// are that instance's, and must not complete instance a.
TEST_F(RegistryLive, AnInstanceWhoseNameExtendsAnotherDoesNotCompleteIt) {
  auto a0 = Registration::start(client_, record("a", 0, 2, "ucx:10.0.0.1:7000"), 3);
  auto x0 = Registration::start(client_, record("a/context/x", 0, 1, "ucx:10.0.0.9:7000"), 3);
  ASSERT_TRUE(a0.isOk() && x0.isOk());
  auto got = findInstance(*client_, "a", "context");
  ASSERT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().toString();
  EXPECT_NE(got.status().message().find("1 of 2 context ranks registered (missing 1)"),
            std::string::npos)
      << got.status().toString();
  x0->reset();
  auto only_x = Registration::start(client_, record("b/context/x", 0, 1, "ucx:10.0.0.9:1"), 3);
  ASSERT_TRUE(only_x.isOk());
  EXPECT_EQ(findInstance(*client_, "b", "context").status().code(), StatusCode::kNotFound);
}

TEST_F(RegistryLive, AHugeInstanceIsReportedIncompleteWithABoundedMessage) {
  // The largest instance a value may claim, one rank of it registered: the lookup answers at
  // once, naming a few missing ranks and counting the rest.
  RankRecord r = record("big", 3, 4096, "ucx:10.0.0.1:7000");
  r.pp = 16;
  auto reg = Registration::start(client_, r, 3);
  ASSERT_TRUE(reg.isOk()) << reg.status().toString();
  auto got = findInstance(*client_, "big", "context");
  ASSERT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().toString();
  EXPECT_NE(got.status().message().find("1 of 65536 context ranks registered (missing 0, 1, 2, "
                                        "4, 5, 6, 7, 8, and 65527 more)"),
            std::string::npos)
      << got.status().toString();
  EXPECT_LT(got.status().message().size(), 200u);
}

TEST_F(RegistryLive, ALostEtcdIsReportedAndTheRankIsRegisteredWhenItReturns) {
  auto r = Registration::start(client_, record("ctx", 0, 1, "ucx:10.0.0.1:7000"), 3);
  ASSERT_TRUE(r.isOk());
  auto kvs = client_->range("hxfer/ctx/");
  ASSERT_TRUE(kvs.isOk() && kvs->size() == 1u);
  // etcd gone for most of a ttl: the registration says so, keeps trying, and is visible again
  // once etcd is back (with the lease etcd kept, or a new one if it had expired).
  etcd_->stop();
  std::this_thread::sleep_for(2500ms);
  EXPECT_FALSE((*r)->reachable());
  EXPECT_GT((*r)->errors(), 0u);
  etcd_->start();
  bool back = false;
  for (int i = 0; i < 100 && !back; ++i) {
    std::this_thread::sleep_for(100ms);
    back = (*r)->reachable() && findInstance(*client_, "ctx", "context").isOk();
  }
  EXPECT_TRUE(back) << "registration not visible after etcd returned";
}

}  // namespace
}  // namespace hxfer::engine
