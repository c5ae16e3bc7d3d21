// Discovery through etcd (DESIGN §13, docs/deployment.md): a rank registers itself under a key
// whose lease it keeps alive; a generation rank finds the context ranks of an instance by name
// and notices when one restarts (a new incarnation under the same key).
//
//   key    hxfer/<instance>/<role>/<rank>            (role: context | generation)
//   value  {"address", "incarnation", "tp", "pp", "rank", "routing"}   JSON
//
// Talks to etcd's v3 JSON gateway (POST /v3/kv/range, /v3/kv/put, /v3/lease/grant,
// /v3/lease/keepalive, /v3/lease/revoke; keys and values base64) over HTTP with libcurl, each
// call bounded by a timeout. A lost etcd stops discovery, never a transfer: registrations keep
// trying and say so once in the log (and in their counters), lookups return Unavailable.
//
// Thread-safety: EtcdClient is safe to share (each call has its own curl handle); a
// Registration owns one keep-alive thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace hxfer::engine {

// The most ranks (tp * pp) an instance in the registry may have.
inline constexpr uint64_t kMaxInstanceRanks = 1u << 16;

struct RankRecord {
  std::string instance, role;  // role: "context" or "generation"
  uint32_t rank = 0, tp = 1, pp = 1;
  std::string address;      // what peers connect to
  std::string incarnation;  // random per process start: a restart changes it
  std::string routing;      // the backend and why, as the rank printed it

  std::string key() const;  // hxfer/<instance>/<role>/<rank>
  std::string toJson() const;
  // Errors name the field: a value a peer wrote must not crash or mislead a reader.
  static StatusOr<RankRecord> fromJson(std::string_view json, std::string_view key);
  bool operator==(const RankRecord&) const = default;
};

class EtcdClient {
 public:
  // `url` is etcd://HOST:PORT (or http://HOST:PORT). Refuses anything else, naming it.
  static StatusOr<std::shared_ptr<EtcdClient>> create(const std::string& url,
                                                      std::chrono::milliseconds timeout);
  const std::string& url() const { return url_; }

  StatusOr<int64_t> grantLease(int64_t ttl_seconds);
  // The lease's remaining TTL in seconds; 0 when etcd no longer has it (expired). Waits at
  // most `max_wait` (and the client's timeout).
  StatusOr<int64_t> keepAlive(
      int64_t lease, std::chrono::milliseconds max_wait = std::chrono::milliseconds::max());
  Status revoke(int64_t lease);
  Status put(const std::string& key, const std::string& value, int64_t lease);
  // Puts `value` under `key` only while the key is absent or holds exactly `value` (one etcd
  // transaction each way): true when it did; false, with the value found in `*held`, when the
  // key holds another; Unavailable when the key kept changing under the transactions.
  StatusOr<bool> putIfAbsentOrSame(const std::string& key, const std::string& value, int64_t lease,
                                   std::string* held);
  // Every key under `prefix`, with its value, in key order.
  StatusOr<std::vector<std::pair<std::string, std::string>>> range(const std::string& prefix);

 private:
  EtcdClient(std::string url, std::string base, std::chrono::milliseconds timeout)
      : url_(std::move(url)), base_(std::move(base)), timeout_(timeout) {}
  // POSTs `body` to base_ + path; the JSON reply, or Unavailable (etcd unreachable) /
  // the gateway's own error (code and message).
  StatusOr<std::string> post(const std::string& path, const std::string& body,
                             std::chrono::milliseconds timeout);
  StatusOr<std::string> post(const std::string& path, const std::string& body) {
    return post(path, body, timeout_);
  }
  std::string url_, base_;
  std::chrono::milliseconds timeout_;
};

// A rank's registration, kept alive by a thread every ttl/3, each call waiting at most that
// (a third of that after a failed call, so one call that times out does not lose the lease). When
// etcd is unreachable it logs that once and keeps trying; when etcd comes back without the lease
// (it expired meanwhile) it registers again under a new one, unless the key now holds another
// record: then a newer process took this rank (a restart while this one hung), and this one stops
// registering (superseded(); never overwriting the newer one). start() itself overwrites, since a
// restarted rank replaces its dead predecessor. The destructor revokes the lease (the key
// disappears).
class Registration {
 public:
  static StatusOr<std::unique_ptr<Registration>> start(std::shared_ptr<EtcdClient> client,
                                                       RankRecord record, int64_t ttl_seconds);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  bool reachable() const { return reachable_; }
  uint64_t errors() const { return errors_; }  // failed keep-alives and puts
  uint64_t reregistered() const { return reregistered_; }
  // The key holds another process's record: this one no longer registers.
  bool superseded() const { return superseded_; }
  int64_t lease() const { return lease_; }  // etcd's id of the lease the key is under now

 private:
  Registration(std::shared_ptr<EtcdClient> client, RankRecord record, int64_t ttl)
      : client_(std::move(client)), record_(std::move(record)), ttl_(ttl) {}
  Status registerOnce();
  // After the lease expired: registers again unless another record holds the key.
  Status registerAgain();
  void run();

  std::shared_ptr<EtcdClient> client_;
  RankRecord record_;
  int64_t ttl_ = 5;
  std::atomic<int64_t> lease_{0};
  std::atomic<bool> reachable_{true}, superseded_{false};
  std::atomic<uint64_t> errors_{0}, reregistered_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// The ranks of `role` in `instance` registered now, in rank order. NotFound while none is;
// Unavailable (naming how many of how many) while some are missing; Incompatible when they
// disagree on tp/pp.
StatusOr<std::vector<RankRecord>> findInstance(EtcdClient& client, const std::string& instance,
                                               const std::string& role);

// A rank's incarnation (engine::newIncarnation, the one its handshakes carry) as registered:
// 16 hex digits.
std::string incarnationText(uint64_t incarnation);

}  // namespace hxfer::engine
