#include "engine/registry.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <mutex>

#include "common/logging.h"

namespace hxfer::engine {
namespace {

using nlohmann::json;

constexpr size_t kMaxReply = 64 << 20;  // a lookup larger than this is not ours

std::string base64(const std::string& in) {
  std::string out(4 * ((in.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(in.data()),
                                static_cast<int>(in.size()));
  out.resize(static_cast<size_t>(std::max(n, 0)));
  return out;
}

StatusOr<std::string> unbase64(const std::string& in, std::string_view what) {
  if (in.size() % 4 != 0) return Corruption(std::string(what) + ": not base64");
  std::string out(in.size() / 4 * 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(in.data()),
                                static_cast<int>(in.size()));
  if (n < 0) return Corruption(std::string(what) + ": not base64");
  size_t pad = 0;
  while (pad < 2 && pad < in.size() && in[in.size() - 1 - pad] == '=') ++pad;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

// The gateway writes int64 as strings ("ID": "758..."); absent means 0.
int64_t int64Field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (...) {
      return 0;
    }
  }
  return 0;
}

size_t onData(char* p, size_t size, size_t n, void* user) {
  auto* out = static_cast<std::string*>(user);
  if (out->size() + size * n > kMaxReply) return 0;  // curl fails the call
  out->append(p, size * n);
  return size * n;
}

// etcd's prefix query: every key k with prefix <= k < range_end.
std::string prefixEnd(std::string p) {
  while (!p.empty()) {
    if (static_cast<unsigned char>(p.back()) < 0xff) {
      ++p.back();
      return p;
    }
    p.pop_back();
  }
  return std::string(1, '\0');  // every key
}

}  // namespace

// ---- RankRecord ----

std::string RankRecord::key() const {
  return "hxfer/" + instance + "/" + role + "/" + std::to_string(rank);
}

std::string RankRecord::toJson() const {
  return json{{"instance", instance},
              {"role", role},
              {"rank", rank},
              {"tp", tp},
              {"pp", pp},
              {"address", address},
              {"incarnation", incarnation},
              {"routing", routing}}
      .dump();
}

StatusOr<RankRecord> RankRecord::fromJson(std::string_view text, std::string_view key) {
  const json j = json::parse(text, nullptr, false);
  const std::string where = "registry value of " + std::string(key);
  if (j.is_discarded() || !j.is_object()) return Corruption(where + ": not a JSON object");
  RankRecord r;
  for (auto [name, field] :
       {std::pair{"instance", &r.instance}, std::pair{"role", &r.role},
        std::pair{"address", &r.address}, std::pair{"incarnation", &r.incarnation}}) {
    auto it = j.find(name);
    if (it == j.end() || !it->is_string() || it->get<std::string>().empty()) {
      return Corruption(where + ": field '" + name + "' missing or not a non-empty string");
    }
    *field = it->get<std::string>();
  }
  for (auto [name, field] :
       {std::pair{"rank", &r.rank}, std::pair{"tp", &r.tp}, std::pair{"pp", &r.pp}}) {
    auto it = j.find(name);
    if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > 1u << 16) {
      return Corruption(where + ": field '" + name + "' missing or not a count (0..65536)");
    }
    *field = it->get<uint32_t>();
  }
  // Each count fits its field; their product is what readers walk, so it is bounded too (a
  // value of tp=65535 pp=65535 passes each field and names 4.3e9 ranks).
  if (uint64_t{r.tp} * r.pp > kMaxInstanceRanks) {
    return Corruption(where + ": tp=" + std::to_string(r.tp) + " pp=" + std::to_string(r.pp) +
                      " make " + std::to_string(uint64_t{r.tp} * r.pp) +
                      " ranks, more than an instance may have (" +
                      std::to_string(kMaxInstanceRanks) + ")");
  }
  if (r.tp == 0 || r.pp == 0 || r.rank >= r.tp * r.pp) {
    return Corruption(where + ": rank " + std::to_string(r.rank) +
                      " does not fit tp=" + std::to_string(r.tp) + " pp=" + std::to_string(r.pp));
  }
  if (auto it = j.find("routing"); it != j.end() && it->is_string()) r.routing = *it;
  if (r.key() != key) {
    return Corruption(where + ": it describes " + r.key() + ", not the key it is stored under");
  }
  return r;
}

std::string incarnationText(uint64_t incarnation) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(incarnation));
  return buf;
}

// ---- EtcdClient ----

StatusOr<std::shared_ptr<EtcdClient>> EtcdClient::create(const std::string& url,
                                                         std::chrono::milliseconds timeout) {
  std::string hostport;
  for (const char* scheme : {"etcd://", "http://"}) {
    if (url.rfind(scheme, 0) == 0) hostport = url.substr(std::string_view(scheme).size());
  }
  while (!hostport.empty() && hostport.back() == '/') hostport.pop_back();
  if (hostport.empty() || hostport.find('/') != std::string::npos ||
      hostport.find(':') == std::string::npos) {
    return InvalidArgument("--registry '" + url + "': expected etcd://HOST:PORT");
  }
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  return std::shared_ptr<EtcdClient>(new EtcdClient(url, "http://" + hostport, timeout));
}

StatusOr<std::string> EtcdClient::post(const std::string& path, const std::string& body,
                                       std::chrono::milliseconds timeout) {
  CURL* c = curl_easy_init();
  if (c == nullptr) return Internal("curl_easy_init failed");
  std::string reply;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  const std::string target = base_ + path;
  curl_easy_setopt(c, CURLOPT_URL, target.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, onData);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &reply);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS,
                   static_cast<long>(std::max<int64_t>(std::min(timeout, timeout_).count(), 1)));
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  const CURLcode rc = curl_easy_perform(c);
  long http = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
  curl_slist_free_all(headers);
  curl_easy_cleanup(c);
  if (rc != CURLE_OK) return Unavailable(url_ + path + ": " + curl_easy_strerror(rc));
  const json j = json::parse(reply, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    // A proxy in front of etcd answers 502/503 with text while etcd restarts: unreachable, not
    // a broken registry.
    if (http != 200) {
      return Unavailable(url_ + path + ": HTTP " + std::to_string(http) + " without a JSON reply");
    }
    return Corruption(url_ + path + ": HTTP " + std::to_string(http) + ", not a JSON reply");
  }
  if (auto e = j.find("error"); e != j.end() || http != 200) {
    const std::string message = e != j.end() && e->is_string() ? e->get<std::string>() : reply;
    // gRPC code 5 (NOT_FOUND): e.g. "etcdserver: requested lease not found".
    if (int64Field(j, "code") == 5) return NotFound(url_ + path + ": " + message);
    return Unavailable(url_ + path + ": HTTP " + std::to_string(http) + ": " + message);
  }
  return reply;
}

StatusOr<int64_t> EtcdClient::grantLease(int64_t ttl) {
  ASSIGN_OR_RETURN(std::string reply, post("/v3/lease/grant", json{{"TTL", ttl}}.dump()));
  const int64_t id = int64Field(json::parse(reply), "ID");
  if (id == 0) return Corruption(url_ + ": lease grant without an ID");
  return id;
}

StatusOr<int64_t> EtcdClient::keepAlive(int64_t lease, std::chrono::milliseconds max_wait) {
  ASSIGN_OR_RETURN(std::string reply, post("/v3/lease/keepalive",
                                           json{{"ID", std::to_string(lease)}}.dump(), max_wait));
  const json j = json::parse(reply);
  return int64Field(j.contains("result") ? j["result"] : j, "TTL");
}

Status EtcdClient::revoke(int64_t lease) {
  return post("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump()).status();
}

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json body{{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  return post("/v3/kv/put", body.dump()).status();
}

StatusOr<bool> EtcdClient::putIfAbsentOrSame(const std::string& key, const std::string& value,
                                             int64_t lease, std::string* held) {
  json put{{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  const json absent{
      {"key", base64(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
  const json same{
      {"key", base64(key)}, {"target", "VALUE"}, {"result", "EQUAL"}, {"value", base64(value)}};
  // absent, same, absent: a key that disappears between two transactions (its lease ran out)
  // is taken by the third.
  for (const json& compare : {absent, same, absent}) {
    const json txn{{"compare", json::array({compare})},
                   {"success", json::array({json{{"request_put", put}}})},
                   {"failure", json::array({json{{"request_range", {{"key", base64(key)}}}}})}};
    ASSIGN_OR_RETURN(std::string reply, post("/v3/kv/txn", txn.dump()));
    const json j = json::parse(reply);
    if (j.value("succeeded", false)) return true;  // the gateway leaves out a false one
    held->clear();
    const json* kv = nullptr;
    if (auto r = j.find("responses"); r != j.end() && r->is_array() && !r->empty()) {
      const json& first = (*r)[0];
      const json& range = first.contains("response_range") ? first["response_range"] : first;
      if (auto kvs = range.find("kvs"); kvs != range.end() && kvs->is_array() && !kvs->empty()) {
        kv = &(*kvs)[0];
      }
    }
    if (kv == nullptr) continue;  // gone between the two: the next compare says
    if (auto v = kv->find("value"); v != kv->end() && v->is_string()) {
      ASSIGN_OR_RETURN(*held, unbase64(*v, "registry value of " + key));
    }
    if (*held != value) return false;
  }
  return Unavailable(url_ + ": " + key + " kept changing under three transactions");
}

StatusOr<std::vector<std::pair<std::string, std::string>>> EtcdClient::range(
    const std::string& prefix) {
  ASSIGN_OR_RETURN(
      std::string reply,
      post("/v3/kv/range",
           json{{"key", base64(prefix)}, {"range_end", base64(prefixEnd(prefix))}}.dump()));
  const json j = json::parse(reply);
  std::vector<std::pair<std::string, std::string>> out;
  if (auto kvs = j.find("kvs"); kvs != j.end() && kvs->is_array()) {
    for (const json& kv : *kvs) {
      if (!kv.contains("key") || !kv["key"].is_string()) continue;
      ASSIGN_OR_RETURN(std::string key, unbase64(kv["key"], "registry key"));
      std::string value;
      if (kv.contains("value") && kv["value"].is_string()) {
        ASSIGN_OR_RETURN(value, unbase64(kv["value"], "registry value of " + key));
      }
      out.emplace_back(std::move(key), std::move(value));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---- Registration ----

StatusOr<std::unique_ptr<Registration>> Registration::start(std::shared_ptr<EtcdClient> client,
                                                            RankRecord record,
                                                            int64_t ttl_seconds) {
  if (ttl_seconds < 2) {
    return InvalidArgument("registry lease ttl " + std::to_string(ttl_seconds) +
                           " s: at least 2 s");
  }
  std::unique_ptr<Registration> r(
      new Registration(std::move(client), std::move(record), ttl_seconds));
  RETURN_IF_ERROR(r->registerOnce());
  r->thread_ = std::thread([p = r.get()] { p->run(); });
  return r;
}

Status Registration::registerOnce() {
  ASSIGN_OR_RETURN(int64_t lease, client_->grantLease(ttl_));
  RETURN_IF_ERROR(client_->put(record_.key(), record_.toJson(), lease));
  lease_ = lease;
  return OkStatus();
}

Status Registration::registerAgain() {
  ASSIGN_OR_RETURN(int64_t lease, client_->grantLease(ttl_));
  std::string held;
  auto put = client_->putIfAbsentOrSame(record_.key(), record_.toJson(), lease, &held);
  if (put.isOk() && *put) {
    lease_ = lease;
    return OkStatus();
  }
  (void)client_->revoke(lease);
  if (!put.isOk()) return put.status();
  auto other = RankRecord::fromJson(held, record_.key());
  superseded_ = true;
  HXFER_LOG_ERROR(
      "registry {}: {} is now held by another process (incarnation {}, this one {}): this rank "
      "was replaced while its lease had expired, and no longer registers",
      client_->url(), record_.key(), other.isOk() ? other->incarnation : "unreadable",
      record_.incarnation);
  return OkStatus();
}

void Registration::run() {
  std::unique_lock lock(mu_);
  const auto period = std::chrono::milliseconds(ttl_ * 1000 / 3);
  // Timed from the start of the last call, so a slow call does not push the next one past the
  // lease's end; after a failure a third of the period.
  auto next = std::chrono::steady_clock::now() + period;
  while (!superseded_ && !cv_.wait_until(lock, next, [&] { return stop_; })) {
    lock.unlock();
    const auto started = std::chrono::steady_clock::now();
    Status s;
    // At most a period a call, so one call that times out leaves a retry a period before the
    // lease's end.
    auto ttl = client_->keepAlive(lease_, period);
    if (ttl.isOk() && *ttl == 0) {  // etcd lost the lease (unreachable longer than the ttl)
      s = registerAgain();
      if (s.isOk() && !superseded_) {
        ++reregistered_;
        HXFER_LOG_WARN("registry {}: the lease of {} had expired; registered again", client_->url(),
                       record_.key());
      }
    } else {
      s = ttl.status();
    }
    next = started + (s.isOk() ? period : period / 3);
    if (!s.isOk()) {
      ++errors_;
      if (reachable_.exchange(false)) {
        HXFER_LOG_WARN(
            "registry {}: unreachable ({}): discovery of {} is paused, transfers continue; "
            "retrying every {} ms",
            client_->url(), s.toString(), record_.key(), (period / 3).count());
      }
    } else if (!reachable_.exchange(true)) {
      HXFER_LOG_WARN("registry {}: reachable again; {} is registered", client_->url(),
                     record_.key());
    }
    lock.lock();
  }
}

Registration::~Registration() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  (void)client_->revoke(lease_);  // best effort: otherwise the key lives out its ttl
}

// ---- Lookup ----

StatusOr<std::vector<RankRecord>> findInstance(EtcdClient& client, const std::string& instance,
                                               const std::string& role) {
  const std::string prefix = "hxfer/" + instance + "/" + role + "/";
  ASSIGN_OR_RETURN(auto kvs, client.range(prefix));
  std::vector<RankRecord> records;
  for (const auto& [key, value] : kvs) {
    // The prefix also matches the keys of an instance named "<instance>/<role>/...": theirs.
    if (key.find('/', prefix.size()) != std::string::npos) continue;
    ASSIGN_OR_RETURN(RankRecord r, RankRecord::fromJson(value, key));
    if (r.instance != instance || r.role != role) continue;
    if (!records.empty() && (r.tp != records[0].tp || r.pp != records[0].pp)) {
      return Incompatible("instance '" + instance + "': " + key +
                          " says tp=" + std::to_string(r.tp) + " pp=" + std::to_string(r.pp) +
                          ", " + records[0].key() + " tp=" + std::to_string(records[0].tp) +
                          " pp=" + std::to_string(records[0].pp));
    }
    records.push_back(std::move(r));
  }
  if (records.empty()) {
    return NotFound("no " + role + " rank of instance '" + instance + "' is registered in " +
                    client.url());
  }
  const uint32_t want = records[0].tp * records[0].pp;
  std::sort(records.begin(), records.end(),
            [](const RankRecord& a, const RankRecord& b) { return a.rank < b.rank; });
  if (records.size() != want) {
    // Name the first few missing ranks only: `want` is bounded, the message need not grow with it.
    constexpr uint32_t kNamed = 8;
    std::string missing;
    uint32_t named = 0;
    for (uint32_t rank = 0, i = 0; rank < want && named <= kNamed; ++rank) {
      if (i < records.size() && records[i].rank == rank) {
        ++i;
      } else if (named++ < kNamed) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
      }
    }
    const size_t absent = want - records.size();
    if (absent > kNamed) missing += ", and " + std::to_string(absent - kNamed) + " more";
    return Unavailable("instance '" + instance + "': " + std::to_string(records.size()) + " of " +
                       std::to_string(want) + " " + role + " ranks registered (missing " + missing +
                       ")");
  }
  return records;
}

}  // namespace hxfer::engine
