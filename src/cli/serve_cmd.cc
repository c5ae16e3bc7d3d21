// `hxfer serve`: one long-running rank.
//   --role context     listens, and serves every request a generation rank asks for with
//                      state filled by the planner's oracle (it stands in for prefill), until
//                      SIGINT/SIGTERM; then prints its metrics as JSON.
//   --role generation  connects to the context ranks (--peers, in global rank order), runs
//                      --requests requests of --tokens tokens, checks every byte against the
//                      oracle, prints a summary and exits 0 when all verified.
#include <signal.h>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache_manager.h"
#include "cli/commands.h"
#include "cli/metrics_http.h"
#include "cli/model_options.h"
#include "common/logging.h"
#include "common/strings.h"
#include "engine/context_sender.h"
#include "engine/generation_receiver.h"
#include "engine/handshake.h"
#include "engine/registry.h"
#include "engine/routing.h"
#include "plan/oracle.h"
#include "transport/transport.h"

namespace hxfer::cli {
namespace {

std::atomic<bool> g_stop{false};
void onSignal(int) { g_stop = true; }

// How long a wait (connecting, a request) runs before it looks at g_stop again: a signal stops
// the rank within about this.
constexpr auto kStopPoll = std::chrono::milliseconds(200);

struct ServeOptions {
  ModelOptions model;
  std::string role;
  uint32_t tp = 1, pp = 1, rank = 0;
  std::string listen, advertise;
  std::string peers;         // comma-separated context addresses (generation)
  std::string registry;      // etcd://HOST:PORT
  std::string instance;      // this instance's name (empty: unique to this process)
  std::string ctx_instance;  // generation: the context instance to find
  uint32_t lease_ttl_s = 5;
  uint32_t peer_tp = 1, peer_pp = 1;
  std::string backend = "auto";
  std::string layout = "auto";
  std::string token;
  bool checksum = false;
  uint32_t blocks = 1024, slots = 64;
  uint32_t requests = 16, tokens = 1000;
  uint32_t timeout_s = 60;
  EngineOptions engine;   // the pools' engine layout (--engine and its options)
  int metrics_port = -1;  // a Prometheus endpoint on this port (0: any); -1: none
  std::string metrics_host = "0.0.0.0";
};

// The labels of every sample a rank's endpoint serves.
std::string promLabels(const char* role, const std::string& instance, uint32_t rank) {
  return engine::prometheusLabel("role", role) + "," +
         engine::prometheusLabel("instance", instance) + "," +
         engine::prometheusLabel("rank", std::to_string(rank));
}

// The Prometheus endpoint of --metrics-port, or nullptr without one; prints where it listens.
StatusOr<std::unique_ptr<MetricsServer>> startMetrics(const ServeOptions& o,
                                                      std::function<std::string()> render) {
  if (o.metrics_port < 0) return std::unique_ptr<MetricsServer>();
  auto server = MetricsServer::start(o.metrics_host, static_cast<uint16_t>(o.metrics_port),
                                     std::move(render));
  if (!server.isOk()) return server.status().withContext("--metrics-port");
  std::printf("metrics on http://%s:%u/metrics\n", o.metrics_host.c_str(), (*server)->port());
  std::fflush(stdout);
  return server;
}

// --advertise HOST or HOST:PORT.
struct Advertised {
  std::string host, port;  // port empty: the one the rank listens on
};

Advertised parseAdvertise(const std::string& a) {
  if (engine::addressBackend(a) == engine::BackendKind::kUcx) {
    return {engine::addressHost(a), a.substr(a.rfind(':') + 1)};
  }
  return {a, ""};
}

// The backend and why, and for a context rank the address it gives its peers. A context
// rank's peers may be on other hosts when it listens on (or advertises) a non-loopback
// address: `auto` then picks ucx. A generation rank follows the context ranks' addresses.
struct ServeRouting {
  engine::Routing routing;
  std::string why;
};

StatusOr<ServeRouting> serveRouting(const ServeOptions& o, bool context,
                                    const std::vector<std::string>& peers,
                                    std::optional<engine::BackendKind> requested,
                                    std::optional<StateLayout> layout, const ModelSpec& model) {
  engine::RoutingEnvironment env = engine::probeRoutingEnvironment();
  std::string why;
  if (context) {
    const std::string listen_host = engine::addressHost(o.listen);
    const std::string adv_host = o.advertise.empty() ? "" : parseAdvertise(o.advertise).host;
    env.peers_same_host = (listen_host.empty() || engine::isLoopbackHost(listen_host)) &&
                          (adv_host.empty() || engine::isLoopbackHost(adv_host));
  } else {
    ASSIGN_OR_RETURN(engine::PeerAddresses given, engine::resolvePeerAddresses(peers));
    const std::optional<engine::BackendKind> named = given.backend;
    const std::string& remote = given.remote_host;
    env.peers_same_host = remote.empty();
    if (named && requested && *requested != *named) {
      return InvalidArgument("--backend " + std::string(engine::backendName(*requested)) +
                             " but --peers are " + std::string(engine::backendName(*named)) +
                             " addresses");
    }
    if (named && !requested) {
      requested = named;
      why = "the context ranks' addresses are " + std::string(engine::backendName(*named)) +
            (remote.empty() ? " on this host" : " (" + remote + ": another host)");
    }
  }
  engine::RoutingExplanation e =
      engine::explainRouting({requested, layout}, env, engine::preferredStateLayout(model));
  if (!e.status.isOk()) return e.status;
  if (why.empty() && !e.decisions.empty()) why = e.decisions.front().reason;
  return ServeRouting{*e.routing, why};
}

// What the options alone refuse, before anything listens, connects or registers (the ranges
// of the numbers are CLI11's checks).
Status checkOptions(const ServeOptions& o) {
  const bool context = o.role == "context";
  if (!context && o.role != "generation") {
    return InvalidArgument("--role '" + o.role + "' is not context or generation");
  }
  // A rank without --listen, or with a loopback one, is reachable from this host only (ucx
  // then binds 127.0.0.1): an address it advertises to other hosts would reach nothing.
  if (context && !o.advertise.empty() && o.backend != "shm") {
    const std::string adv_host = parseAdvertise(o.advertise).host;
    const bool loopback_listener =
        o.listen.empty() || (engine::addressBackend(o.listen) == engine::BackendKind::kUcx &&
                             engine::isLoopbackHost(engine::addressHost(o.listen)));
    if (loopback_listener && !adv_host.empty() && !engine::isLoopbackHost(adv_host) &&
        !engine::isWildcardHost(adv_host)) {
      return InvalidArgument(
          "--advertise " + o.advertise + " is for peers on other hosts, but " +
          (o.listen.empty() ? std::string("without --listen the rank listens on loopback")
                            : "--listen " + o.listen + " is a loopback address") +
          ": pass --listen 0.0.0.0:PORT (or the address of the interface they reach)");
    }
  }
  if (!context && o.ctx_instance.empty()) {
    const size_t peers = splitList(o.peers).size();
    if (peers == 0) {
      return InvalidArgument(
          "--peers is empty: a generation rank connects to the context ranks it names (or "
          "finds them with --ctx-instance in --registry)");
    }
    if (peers != static_cast<size_t>(o.peer_tp) * o.peer_pp) {
      return InvalidArgument("--peers gives " + std::to_string(peers) +
                             (peers == 1 ? " address" : " addresses") + ", but --peer-tp " +
                             std::to_string(o.peer_tp) + " x --peer-pp " +
                             std::to_string(o.peer_pp) + " is " +
                             std::to_string(o.peer_tp * o.peer_pp) + " context ranks");
    }
  }
  return OkStatus();
}

// The address peers use: the agent's, with --advertise's host (and port) in it. Refuses what
// peers on other hosts could not reach.
StatusOr<std::string> advertisedAddress(const ServeOptions& o, const std::string& local) {
  const std::string listen_host = engine::addressHost(o.listen);
  const bool remote_listener = !listen_host.empty() && !engine::isLoopbackHost(listen_host);
  if (o.advertise.empty()) {
    if (engine::isWildcardHost(listen_host)) {
      return InvalidArgument("--listen " + o.listen +
                             " listens on every interface: give --advertise HOST, an address "
                             "the peers reach");
    }
    return local;
  }
  if (engine::addressBackend(local) != engine::BackendKind::kUcx) {
    return InvalidArgument("--advertise " + o.advertise + ": only ucx addresses are advertised (" +
                           local + " is reachable on this host only)");
  }
  const Advertised adv = parseAdvertise(o.advertise);
  if (adv.host.empty()) return InvalidArgument("--advertise '" + o.advertise + "' has no host");
  if (remote_listener && engine::isLoopbackHost(adv.host)) {
    return InvalidArgument("--advertise " + o.advertise + " is a loopback address, but --listen " +
                           o.listen + " serves other hosts: advertise an address they reach");
  }
  if (engine::isWildcardHost(adv.host)) {
    return InvalidArgument("--advertise " + o.advertise + " is no host's address");
  }
  const std::string port = adv.port.empty() ? local.substr(local.rfind(':') + 1) : adv.port;
  return "ucx:" + adv.host + ":" + port;
}

// The context instance's ranks, waiting up to `timeout` for every one to be registered.
StatusOr<std::vector<engine::RankRecord>> discover(engine::EtcdClient& registry,
                                                   const std::string& instance,
                                                   std::chrono::seconds timeout) {
  const auto deadline = engine::Clock::now() + timeout;
  while (true) {
    auto f = engine::findInstance(registry, instance, "context");
    if (f.isOk() || f.status().code() == StatusCode::kCorruption ||
        f.status().code() == StatusCode::kIncompatible || engine::Clock::now() > deadline) {
      return f;
    }
    if (g_stop) return Cancelled("stopped by a signal while looking for instance " + instance);
    std::this_thread::sleep_for(kStopPoll);
  }
}

// Whether any rank's registration differs from what the receiver connected to (a restart:
// new incarnation, maybe a new address).
std::string changedRanks(const std::vector<engine::RankRecord>& was,
                         const std::vector<engine::RankRecord>& now) {
  std::string out;
  for (size_t i = 0; i < was.size() && i < now.size(); ++i) {
    if (was[i].incarnation != now[i].incarnation || was[i].address != now[i].address) {
      out += (out.empty() ? "" : "; ") + now[i].key() + " incarnation " + was[i].incarnation +
             " -> " + now[i].incarnation + " at " + now[i].address;
    }
  }
  if (was.size() != now.size()) out += (out.empty() ? "" : "; ") + std::string("ranks changed");
  return out;
}

// Waits for request `id` in slices of kStopPoll. After a signal, or past `deadline`, the request
// is cancelled, and its result is then the failure that says so.
StatusOr<engine::RequestResult> waitOrStop(engine::GenerationReceiver& rx, uint64_t id,
                                           engine::Clock::time_point deadline) {
  while (true) {
    ASSIGN_OR_RETURN(engine::RequestResult r,
                     rx.wait(id, std::min(deadline, engine::Clock::now() + kStopPoll)));
    if (r.terminal()) return r;
    if (g_stop || engine::Clock::now() >= deadline) {
      RETURN_IF_ERROR(rx.cancel(id));
      return rx.poll(id);
    }
  }
}

int runServe(const ServeOptions& o) {
  // Line by line, even into a pipe: what a rank says (found, reconnecting, request N failed)
  // is read as it happens by whoever supervises it.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (Status s = checkOptions(o); !s.isOk()) return reportError(s);
  // From here a signal stops the rank at the next point it looks (kStopPoll at most while it
  // waits), which then reports as it does at its end.
  ::signal(SIGINT, onSignal);
  ::signal(SIGTERM, onSignal);
  auto model = resolveModel(o.model);
  if (!model.isOk()) return reportError(model.status());
  ParallelConfig pc{o.tp, o.pp, {}};
  if (Status s = pc.validate(model->numLayers()); !s.isOk()) return reportError(s);
  if (o.rank >= pc.worldSize()) {
    return reportError(InvalidArgument("--rank " + std::to_string(o.rank) +
                                       " >= tp*pp=" + std::to_string(pc.worldSize())));
  }
  const bool context = o.role == "context";
  if (context && o.instance.empty() && !o.registry.empty()) {
    return reportError(InvalidArgument(
        "--instance is empty: a context rank registers under its instance's name (the "
        "generation ranks' --ctx-instance)"));
  }
  auto instance =
      engine::instanceName(o.instance, context ? "ctx" : "gen", pc.worldSize(), "--instance");
  if (!instance.isOk()) return reportError(instance.status());
  auto backend = engine::parseBackendRequest(o.backend);
  if (!backend.isOk()) return reportError(backend.status().withContext("--backend"));
  auto layout = parseStateLayoutOption("--layout", o.layout);
  if (!layout.isOk()) return reportError(layout.status());
  // A generation rank's peers: --peers, or the context instance registered in --registry.
  std::shared_ptr<engine::EtcdClient> registry;
  if (!o.registry.empty()) {
    auto c = engine::EtcdClient::create(o.registry, std::chrono::seconds(2));
    if (!c.isOk()) return reportError(c.status());
    registry = *c;
  }
  std::vector<std::string> peers = splitList(o.peers);
  uint32_t peer_tp = o.peer_tp, peer_pp = o.peer_pp;
  std::vector<engine::RankRecord> found;
  if (!context && !o.ctx_instance.empty()) {
    if (!registry) return reportError(InvalidArgument("--ctx-instance needs --registry"));
    if (!peers.empty()) {
      return reportError(InvalidArgument("--peers and --ctx-instance both name the context ranks"));
    }
    auto f = discover(*registry, o.ctx_instance, std::chrono::seconds(o.timeout_s));
    if (!f.isOk()) return reportError(f.status());
    found = std::move(*f);
    peer_tp = found[0].tp;
    peer_pp = found[0].pp;
    for (const engine::RankRecord& r : found) {
      peers.push_back(r.address);
      std::printf("found %s: %s (incarnation %s)\n", r.key().c_str(), r.address.c_str(),
                  r.incarnation.c_str());
    }
  }
  auto served = serveRouting(o, context, peers, *backend, *layout, *model);
  if (!served.isOk()) return reportError(served.status());
  const engine::Routing* routing = &served->routing;
  std::printf("instance: %s\n", instance->c_str());
  std::printf("routing: backend %s, state layout %s (%s)\n",
              std::string(engine::backendName(routing->backend)).c_str(),
              std::string(stateLayoutName(routing->state_layout)).c_str(), served->why.c_str());

  const uint32_t tp_rank = o.rank % o.tp, pp_rank = o.rank / o.tp;
  // The pools as the engine of --engine keeps them (hxfer's: the state layout routed above).
  auto engine_layout =
      resolveEngineLayout(o.engine, "", std::string(stateLayoutName(routing->state_layout)));
  if (!engine_layout.isOk()) return reportError(engine_layout.status());
  if (engine_layout->engine != Engine::kHxfer) {
    std::printf("engine layout: %s\n", engine_layout->toString().c_str());
  }
  auto cache = HybridCacheManager::create(
      *model, pc, tp_rank, pp_rank, *engine_layout, Capacity::counts(o.blocks, o.slots),
      routing->backend == engine::BackendKind::kShm ? Region::Backing::kMemfd
                                                    : Region::Backing::kAnonymous);
  if (!cache.isOk()) return reportError(cache.status());
  transport::AgentConfig ac;
  ac.backend = std::string(engine::backendName(routing->backend));
  ac.listen = o.listen;
  ac.label = o.role;
  ac.auth_token = o.token;
  auto agent = transport::createAgent(ac);
  if (!agent.isOk()) return reportError(agent.status());
  HybridCacheManager& pool = **cache;
  const RankMemory mem = engine::cacheMemory(pool);

  if (context) {
    engine::ContextSender::Options so;
    so.instance_id = *instance;
    so.model = *model;
    so.parallel = pc;
    so.tp_rank = tp_rank;
    so.pp_rank = pp_rank;
    so.checksum = o.checksum;
    engine::ContextSender* sender_ptr = nullptr;
    so.on_request = [&](uint64_t id, uint64_t tokens, const Bytes&) {
      // Stands in for prefill: the state is the oracle's.
      auto a = pool.allocate(id, static_cast<uint32_t>(tokens));
      if (!a.isOk()) return;  // the generation side times out; a real server would queue
      (void)fillRank(pool.layout(), mem, idsOf(*a), id);
      (void)sender_ptr->markReady(id);
    };
    auto sender = engine::ContextSender::create(so, &pool, std::move(*agent));
    if (!sender.isOk()) return reportError(sender.status());
    sender_ptr = sender->get();
    auto address = advertisedAddress(o, (*sender)->address());
    if (!address.isOk()) {
      (*sender)->shutdown();
      return reportError(address.status());
    }
    std::printf("context rank %u listening on %s\n", o.rank, address->c_str());
    std::unique_ptr<engine::Registration> registration;
    if (registry) {
      engine::RankRecord rec;
      rec.instance = *instance;
      rec.role = "context";
      rec.rank = o.rank;
      rec.tp = o.tp;
      rec.pp = o.pp;
      rec.address = *address;
      rec.incarnation = engine::incarnationText((*sender)->incarnation());
      rec.routing = served->why;
      auto r = engine::Registration::start(registry, rec, o.lease_ttl_s);
      if (!r.isOk()) {
        (*sender)->shutdown();
        return reportError(r.status().withContext("--registry"));
      }
      registration = std::move(*r);
      std::printf("registered %s (incarnation %s) in %s, lease %u s\n", rec.key().c_str(),
                  rec.incarnation.c_str(), registry->url().c_str(), o.lease_ttl_s);
    }
    const std::string labels = promLabels("context", *instance, o.rank);
    auto metrics = startMetrics(o, [&] {
      std::string text = (*sender)->metrics().toPrometheus(labels);
      if (registration) {
        text +=
            "# HELP hxfer:registry_errors_total Failed registry calls (etcd).\n"
            "# TYPE hxfer:registry_errors_total counter\n"
            "hxfer:registry_errors_total{" +
            labels + "} " + std::to_string(registration->errors()) + "\n";
      }
      return text;
    });
    if (!metrics.isOk()) {
      (*sender)->shutdown();
      return reportError(metrics.status());
    }
    std::fflush(stdout);
    while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    metrics->reset();
    nlohmann::json reg;
    if (registration) {
      reg = {{"reachable", registration->reachable()},
             {"errors", registration->errors()},
             {"reregistered", registration->reregistered()},
             {"superseded", registration->superseded()}};
      registration.reset();  // unregisters: peers stop finding this rank
    }
    (*sender)->shutdown();
    // Every page a request took is back once the sender let go of it: the accounting check.
    auto j = nlohmann::json::parse((*sender)->metrics().toJson());
    if (!reg.is_null()) j["registry"] = reg;
    const uint64_t leaked = pool.counters().pagesHeld();
    j["leaked_pages"] = leaked;
    std::printf("%s\n", j.dump().c_str());
    return leaked == 0 ? 0 : 1;
  }

  engine::GenerationReceiver::Options ro;
  ro.instance_id = *instance;
  ro.model = *model;
  ro.parallel = pc;
  ro.tp_rank = tp_rank;
  ro.pp_rank = pp_rank;
  ro.checksum = o.checksum;
  ro.request_timeout = std::chrono::seconds(o.timeout_s);
  // A receiver towards `addresses`; the first one takes the agent made above. After a signal
  // it is returned unconnected: the request loop then ends at once.
  std::unique_ptr<transport::Agent> first_agent = std::move(*agent);
  auto connect = [&](const std::vector<std::string>& addresses)
      -> StatusOr<std::unique_ptr<engine::GenerationReceiver>> {
    std::unique_ptr<transport::Agent> a = std::move(first_agent);
    if (a == nullptr) {
      ASSIGN_OR_RETURN(a, transport::createAgent(ac));
    }
    ro.ctx_parallel = ParallelConfig{peer_tp, peer_pp, {}};
    ro.ctx_addresses = addresses;
    ASSIGN_OR_RETURN(auto rx, engine::GenerationReceiver::create(ro, &pool, std::move(a)));
    const auto deadline = engine::Clock::now() + std::chrono::seconds(o.timeout_s);
    while (true) {
      Status s = rx->waitForPeers(std::min(deadline, engine::Clock::now() + kStopPoll));
      if (s.isOk() || g_stop) return rx;
      if (s.code() != StatusCode::kTimeout || engine::Clock::now() >= deadline) return s;
    }
  };
  auto rx = connect(peers);
  if (!rx.isOk()) return reportError(rx.status());

  // With a registry: a context rank that restarted (a new incarnation) is reconnected to, at
  // once after a failed request and otherwise once a second; a lost etcd pauses this, never
  // the transfers.
  std::atomic<uint64_t> reconnects{0}, registry_errors{0};
  std::mutex rx_mu;                 // guards rx and retired against the metrics endpoint's thread
  engine::MetricsSnapshot retired;  // the receivers replaced by reconnects, summed
  bool registry_reachable = true;
  auto last_check = engine::Clock::now();
  auto rediscover = [&](std::chrono::seconds wait_for_change) -> Status {
    const auto deadline = engine::Clock::now() + wait_for_change;
    while (true) {
      auto now = engine::findInstance(*registry, o.ctx_instance, "context");
      if (!now.isOk()) {
        ++registry_errors;
        if (registry_reachable && now.status().code() == StatusCode::kUnavailable &&
            now.status().message().find(registry->url()) != std::string::npos) {
          registry_reachable = false;
          HXFER_LOG_WARN("registry {}: unreachable ({}): discovery paused, transfers continue",
                         registry->url(), now.status().toString());
        }
      } else {
        if (!registry_reachable) {
          registry_reachable = true;
          HXFER_LOG_WARN("registry {}: reachable again; discovery resumed", registry->url());
        }
        const std::string changed = changedRanks(found, *now);
        if (!changed.empty()) {
          std::printf("context instance %s changed (%s): reconnecting\n", o.ctx_instance.c_str(),
                      changed.c_str());
          (*rx)->shutdown();
          std::vector<std::string> addresses;
          for (const engine::RankRecord& r : *now) addresses.push_back(r.address);
          auto next = connect(addresses);
          if (!next.isOk()) return next.status();
          std::lock_guard lock(rx_mu);
          // The old receiver's counts stay in the scrape (counters never go back); its
          // gauges do not.
          engine::MetricsSnapshot last = (*rx)->metrics();
          last.accounting_errors = 0;
          last.ranks_without_token = 0;
          retired.merge(last);
          rx = std::move(next);
          found = std::move(*now);
          ++reconnects;
          return OkStatus();
        }
      }
      if (engine::Clock::now() >= deadline || g_stop) return OkStatus();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  };

  const std::string labels = promLabels("generation", *instance, o.rank);
  auto metrics = startMetrics(o, [&] {
    std::lock_guard lock(rx_mu);
    engine::MetricsSnapshot m = retired;
    m.merge((*rx)->metrics());
    std::string text = m.toPrometheus(labels);
    if (registry) {
      text +=
          "# HELP hxfer:registry_errors_total Failed registry calls (etcd).\n"
          "# TYPE hxfer:registry_errors_total counter\n"
          "hxfer:registry_errors_total{" +
          labels + "} " + std::to_string(registry_errors.load()) + "\n";
      text +=
          "# HELP hxfer:instance_reconnects_total Reconnections to a restarted context "
          "instance.\n# TYPE hxfer:instance_reconnects_total counter\n"
          "hxfer:instance_reconnects_total{" +
          labels + "} " + std::to_string(reconnects.load()) + "\n";
    }
    return text;
  });
  if (!metrics.isOk()) return reportError(metrics.status());

  uint32_t ok = 0;
  uint64_t bytes = 0;
  std::vector<double> latencies_us;
  // Request ids are one space on the context side: every rank of this instance numbers from
  // the same base (its name's hash), another instance from another.
  const uint64_t first_id = (XXH3_64bits(instance->data(), instance->size()) & 0xffffffffull) << 20;
  if (!g_stop) std::printf("request ids from %llu\n", static_cast<unsigned long long>(first_id));
  for (uint64_t id = first_id; id < first_id + o.requests && !g_stop; ++id) {
    if (!found.empty() && engine::Clock::now() - last_check > std::chrono::seconds(1)) {
      last_check = engine::Clock::now();
      if (Status s = rediscover(std::chrono::seconds(0)); !s.isOk()) return reportError(s);
    }
    bool failed = true;
    auto a = (*rx)->startRequest(id, o.tokens);
    if (!a.isOk()) {
      if (found.empty()) return reportError(a.status());
      std::printf("request %llu: %s\n", static_cast<unsigned long long>(id),
                  a.status().toString().c_str());
    } else {
      auto res = waitOrStop(**rx, id, engine::Clock::now() + std::chrono::seconds(o.timeout_s + 5));
      if (!res.isOk()) return reportError(res.status());
      if (res->status.isOk()) {
        bytes += res->bytes;
        latencies_us.push_back(static_cast<double>(res->latency.count()) / 1e3);
        // The request's tokens: a context side with another block size moves exactly those
        // (with the same size, whole blocks move and the tokens checked are a part of them).
        auto check = checkRank(pool.layout(), mem, idsOf(*a), id,
                               BlockRange{0, static_cast<uint32_t>(a->blocks.size())}, o.tokens);
        if (check.isOk() && check->ok()) {
          ++ok;
          failed = false;
        } else {
          std::printf("request %llu: %s\n", static_cast<unsigned long long>(id),
                      check.isOk() ? check->toString().c_str() : check.status().toString().c_str());
        }
      } else {
        std::printf("request %llu: %s\n", static_cast<unsigned long long>(id),
                    res->status.toString().c_str());
      }
      (void)(*rx)->release(id);
    }
    if (failed && !found.empty()) {
      last_check = engine::Clock::now();
      if (Status s = rediscover(std::chrono::seconds(o.timeout_s)); !s.isOk()) {
        return reportError(s);
      }
    }
  }
  metrics->reset();
  (*rx)->shutdown();
  if (g_stop) std::printf("stopped by a signal\n");
  const uint64_t leaked = pool.counters().pagesHeld();
  std::sort(latencies_us.begin(), latencies_us.end());
  const double p50 = latencies_us.empty() ? 0 : latencies_us[latencies_us.size() / 2];
  std::printf("%u of %u requests verified, %llu bytes, p50 %.1f us, leaked pages %llu", ok,
              o.requests, static_cast<unsigned long long>(bytes), p50,
              static_cast<unsigned long long>(leaked));
  if (registry) {
    std::printf(", reconnects %llu, registry errors %llu",
                static_cast<unsigned long long>(reconnects.load()),
                static_cast<unsigned long long>(registry_errors.load()));
  }
  std::printf("\n");
  return ok == o.requests && leaked == 0 ? 0 : 1;
}

}  // namespace

void addServeCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Run one context or generation rank");
  auto o = std::make_shared<ServeOptions>();
  addModelOptions(cmd, &o->model);
  cmd->add_option("--role", o->role, "context or generation")->required();
  addParallelSize(cmd, "--tp", &o->tp, "Tensor parallel size of this instance", 1);
  addParallelSize(cmd, "--pp", &o->pp, "Pipeline parallel size of this instance", 1);
  cmd->add_option("--rank", o->rank, "Global rank in this instance (pp_rank * tp + tp_rank)")
      ->default_val(0);
  cmd->add_option("--listen", o->listen,
                  "Listen address (shm: socket name; ucx: ip:port, 0.0.0.0:port for every "
                  "interface); empty picks one");
  cmd->add_option("--advertise", o->advertise,
                  "Context: the address peers connect to, HOST or HOST:PORT, when it differs "
                  "from --listen (NAT, every interface); never a loopback one while --listen "
                  "serves other hosts, nor another host's while it serves this one only "
                  "(no --listen, or a loopback one)");
  cmd->add_option("--peers", o->peers,
                  "Generation: context rank addresses, comma-separated, in global rank order");
  cmd->add_option("--registry", o->registry,
                  "etcd://HOST:PORT: context ranks register there under a lease they keep "
                  "alive; generation ranks find --ctx-instance there");
  cmd->add_option("--instance", o->instance,
                  "This instance's name, shared by its ranks: in the handshake, and for a "
                  "context rank the registry key hxfer/NAME/context/RANK. Default: a name unique "
                  "to this process, for an instance of one rank that does not register");
  cmd->add_option("--ctx-instance", o->ctx_instance,
                  "Generation: find the context ranks of instance NAME in --registry (instead "
                  "of --peers) and reconnect when one restarts");
  cmd->add_option("--lease-ttl", o->lease_ttl_s,
                  "Context: seconds a registration outlives its rank (kept alive every third)")
      ->default_val(5)
      ->check(CLI::Range(2u, std::numeric_limits<uint32_t>::max()));
  addParallelSize(cmd, "--peer-tp", &o->peer_tp, "Generation: the context instance's tp", 1);
  addParallelSize(cmd, "--peer-pp", &o->peer_pp, "Generation: the context instance's pp", 1);
  cmd->add_option("--backend", o->backend,
                  "auto, shm or ucx; auto: ucx when peers may be on other hosts (a non-loopback "
                  "--listen/--advertise, or --peers on another host), else shm")
      ->default_val("auto");
  cmd->add_option("--layout", o->layout, "State layout: auto, paged, layer-major")
      ->default_val("auto");
  cmd->add_option(
      "--token", o->token,
      "Shared secret both sides prove they hold (never sent); empty: none, with a warning");
  cmd->add_flag("--checksum", o->checksum, "End-to-end xxh3 checksum per request part");
  cmd->add_option("--blocks", o->blocks, "KV blocks in this rank's pool")->default_val(1024);
  cmd->add_option("--slots", o->slots, "State slots in this rank's pool")->default_val(64);
  cmd->add_option("--requests", o->requests, "Generation: requests to run")->default_val(16);
  cmd->add_option("--tokens", o->tokens, "Generation: tokens per request")->default_val(1000);
  cmd->add_option("--timeout", o->timeout_s, "Seconds for connecting and per request")
      ->default_val(60);
  cmd->add_option("--engine", o->engine.engine,
                  "The pools' layout as an engine keeps them: hxfer, trtllm-v1, trtllm-v2, vllm, "
                  "vllm-0.25, sglang (docs/layouts.md); the peer may use another")
      ->default_val("hxfer");
  cmd->add_option("--kv-layout", o->engine.kv,
                  "With --engine: kv order, nhd or hnd (trtllm-v2, vllm-0.25; vllm: K and V "
                  "side by side per token and head), cpu or cpu-amx (vllm)");
  cmd->add_option("--conv-layout", o->engine.conv, "With --engine vllm: conv order, sd or ds");
  cmd->add_option("--shared-tensors", o->engine.shared,
                  "With --engine vllm: on for the hybrid manager's shared per-group tensors");
  cmd->add_option("--metrics-port", o->metrics_port,
                  "Serve Prometheus metrics on this port (0: any, printed), GET /metrics")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--metrics-host", o->metrics_host,
                  "Address the metrics endpoint listens on (IPv4)")
      ->default_val("0.0.0.0")
      ->check(CLI::ValidIPV4);
  cmd->callback([o] {
    const int rc = runServe(*o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace hxfer::cli
