#include "engine/routing.h"

#include <gtest/gtest.h>

#include <string>

#include "model/presets.h"

namespace hxfer::engine {
namespace {

using Backend = std::optional<BackendKind>;
using Layout = std::optional<StateLayout>;
constexpr auto kPaged = StateLayout::kPaged;
constexpr auto kLayerMajor = StateLayout::kLayerMajor;

RoutingEnvironment env(bool same_host, bool single_process, bool ucx_compiled, bool ucx_cheap) {
  RoutingEnvironment e;
  e.peers_same_host = same_host;
  e.single_process = single_process;
  e.ucx_compiled = ucx_compiled;
  e.ucx_cheap_small_writes = ucx_cheap;
  return e;
}

// Hand-written rows: the cases a reader would check first.
struct Row {
  const char* what;
  Backend backend;
  Layout layout;
  Layout preference;
  RoutingEnvironment env;
  // Expected outcome: ok with (backend, layout), or an error whose message has `error_has`.
  std::optional<Routing> expect;
  StatusCode code = StatusCode::kOk;
  std::vector<std::string> error_has = {};
};

TEST(Routing, HandWrittenRowsResolveAsDocumented) {
  const auto local = env(true, false, true, false);
  const auto remote = env(false, false, true, false);
  const auto remote_rma = env(false, false, true, true);
  const auto remote_no_ucx = env(false, false, false, false);
  const auto in_process = env(true, true, true, false);
  const std::vector<Row> rows = {
      {"auto on one host is shm + paged for a hybrid",
       {},
       {},
       kPaged,
       local,
       Routing{BackendKind::kShm, kPaged}},
      {"auto across hosts without RMA is ucx + layer-major",
       {},
       {},
       kPaged,
       remote,
       Routing{BackendKind::kUcx, kLayerMajor}},
      {"auto across hosts with RMA is ucx + paged",
       {},
       {},
       kPaged,
       remote_rma,
       Routing{BackendKind::kUcx, kPaged}},
      {"auto never picks inproc even in one process",
       {},
       {},
       kPaged,
       in_process,
       Routing{BackendKind::kShm, kPaged}},
      {"attention-only model takes paged on shm",
       {},
       {},
       {},
       local,
       Routing{BackendKind::kShm, kPaged}},
      {"explicit layer-major overrides the model's preference", BackendKind::kShm, kLayerMajor,
       kPaged, local, Routing{BackendKind::kShm, kLayerMajor}},
      {"explicit ucx + paged without RMA is honoured", BackendKind::kUcx, kPaged, kPaged, remote,
       Routing{BackendKind::kUcx, kPaged}},
      {"explicit ucx + layer-major works without RMA", BackendKind::kUcx, kLayerMajor, kPaged,
       remote, Routing{BackendKind::kUcx, kLayerMajor}},
      {"shm across hosts is refused",
       BackendKind::kShm,
       {},
       kPaged,
       remote,
       std::nullopt,
       StatusCode::kInvalidArgument,
       {"backend=shm", "peers=other-host", "this host"}},
      {"inproc across processes is refused",
       BackendKind::kInproc,
       {},
       kPaged,
       local,
       std::nullopt,
       StatusCode::kInvalidArgument,
       {"backend=inproc", "separate processes", "one process"}},
      {"inproc in one process is fine", BackendKind::kInproc, kPaged, kPaged, in_process,
       Routing{BackendKind::kInproc, kPaged}},
      {"ucx not compiled in is refused",
       BackendKind::kUcx,
       {},
       kPaged,
       env(true, false, false, false),
       std::nullopt,
       StatusCode::kInvalidArgument,
       {"backend=ucx", "not compiled"}},
      {"auto across hosts without ucx finds nothing",
       {},
       {},
       kPaged,
       remote_no_ucx,
       std::nullopt,
       StatusCode::kUnavailable,
       {"backend=auto", "ucx is not compiled in"}},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.what);
    RoutingExplanation e = explainRouting({row.backend, row.layout}, row.env, row.preference);
    if (row.expect) {
      ASSERT_TRUE(e.status.isOk()) << e.status.toString();
      ASSERT_TRUE(e.routing.has_value());
      EXPECT_EQ(e.routing->backend, row.expect->backend);
      EXPECT_EQ(e.routing->state_layout, row.expect->state_layout);
    } else {
      EXPECT_EQ(e.status.code(), row.code) << e.status.toString();
      EXPECT_FALSE(e.routing.has_value());
      for (const auto& s : row.error_has) {
        EXPECT_NE(e.status.message().find(s), std::string::npos)
            << "'" << s << "' missing from: " << e.status.message();
      }
    }
  }
}

// The whole matrix, against the rules of DESIGN §8 restated independently here.
TEST(Routing, EveryCombinationFollowsTheResolutionRules) {
  const std::vector<Backend> backends = {std::nullopt, BackendKind::kInproc, BackendKind::kShm,
                                         BackendKind::kUcx};
  const std::vector<Layout> layouts = {std::nullopt, kPaged, kLayerMajor};
  int rows = 0;
  for (Backend backend : backends) {
    for (Layout layout : layouts) {
      for (Layout pref : layouts) {
        for (int bits = 0; bits < 16; ++bits) {
          const RoutingEnvironment e = env(bits & 1, bits & 2, bits & 4, bits & 8);
          ++rows;
          SCOPED_TRACE("row " + std::to_string(rows));
          RoutingExplanation x = explainRouting({backend, layout}, e, pref);

          // Step 1, restated.
          std::optional<BackendKind> want_backend;
          if (backend == BackendKind::kInproc) {
            if (e.single_process) want_backend = backend;
          } else if (backend == BackendKind::kShm) {
            if (e.peers_same_host) want_backend = backend;
          } else if (backend == BackendKind::kUcx) {
            if (e.ucx_compiled) want_backend = backend;
          } else if (e.peers_same_host) {
            want_backend = BackendKind::kShm;
          } else if (e.ucx_compiled) {
            want_backend = BackendKind::kUcx;
          }
          if (!want_backend) {
            EXPECT_FALSE(x.status.isOk());
            EXPECT_TRUE(x.decisions.empty());
            continue;
          }
          ASSERT_GE(x.decisions.size(), 2u) << x.status.toString();
          EXPECT_EQ(x.decisions[0].setting, "backend");
          EXPECT_EQ(x.decisions[0].value, backendName(*want_backend));
          EXPECT_FALSE(x.decisions[0].reason.empty());

          // Step 2, restated: only after the backend is known.
          const bool cheap = *want_backend != BackendKind::kUcx || e.ucx_cheap_small_writes;
          StateLayout want_layout;
          if (layout) {
            want_layout = *layout;
          } else if (pref == kLayerMajor) {
            want_layout = kLayerMajor;
          } else {
            want_layout = cheap ? kPaged : kLayerMajor;
          }
          EXPECT_EQ(x.decisions[1].setting, "state_layout");
          EXPECT_EQ(x.decisions[1].value, stateLayoutName(want_layout));

          // Step 3, restated: every resolved pair is usable; paged on a backend where
          // records cost a message says so.
          ASSERT_TRUE(x.status.isOk()) << x.status.toString();
          ASSERT_EQ(x.decisions.size(), 3u);
          EXPECT_EQ(x.decisions[2].setting, "combination");
          EXPECT_EQ(x.decisions[2].reason.find("slower") != std::string::npos,
                    want_layout == kPaged && !cheap)
              << x.decisions[2].reason;
          EXPECT_EQ(x.routing->backend, *want_backend);
          EXPECT_EQ(x.routing->state_layout, want_layout);
          auto r = resolveRouting({backend, layout}, e, pref);
          ASSERT_TRUE(r.isOk());
          EXPECT_EQ(r->backend, *want_backend);
          EXPECT_EQ(r->state_layout, want_layout);
        }
      }
    }
  }
  EXPECT_EQ(rows, 4 * 3 * 3 * 16);
}

TEST(Routing, HybridPresetsPreferPaged) {
  for (const auto& name : presetNames()) {
    auto m = loadPreset(name);
    ASSERT_TRUE(m.isOk()) << name;
    bool recurrent = false;
    for (const auto& l : m->layers) recurrent |= l.hasRecurrent();
    if (recurrent) {
      EXPECT_EQ(preferredStateLayout(*m), kPaged) << name;
    }
  }
  ModelSpec attention_only;
  LayerSpec a;
  a.attention = AttentionShape{2, 8};
  attention_only.layers = {a, a};
  EXPECT_EQ(preferredStateLayout(attention_only), std::nullopt);
}

TEST(Routing, ParsersAcceptAutoAndNamesAndRejectOthers) {
  auto b = parseBackendRequest("auto");
  ASSERT_TRUE(b.isOk());
  EXPECT_FALSE(b->has_value());
  for (BackendKind k :
       {BackendKind::kInproc, BackendKind::kShm, BackendKind::kUcx, BackendKind::kCuda}) {
    auto p = parseBackendRequest(backendName(k));
    ASSERT_TRUE(p.isOk());
    EXPECT_EQ(**p, k);
  }
  auto bad = parseBackendRequest("rdma");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("rdma"), std::string::npos);
  auto l = parseStateLayoutRequest("auto");
  ASSERT_TRUE(l.isOk());
  EXPECT_FALSE(l->has_value());
  auto lm = parseStateLayoutRequest("layer-major");
  ASSERT_TRUE(lm.isOk());
  EXPECT_EQ(**lm, kLayerMajor);
  EXPECT_FALSE(parseStateLayoutRequest("diagonal").isOk());
}

}  // namespace
}  // namespace hxfer::engine

namespace hxfer::engine {
namespace {

// Engine memory that has no memfd cannot be handed to a same-host peer: auto goes to ucx and
// says so; shm asked by name is refused, naming the memory.
TEST(Routing, PrivateEngineMemoryRoutesToUcxAndRefusesShm) {
  RoutingEnvironment e;
  e.ucx_compiled = true;
  e.memory_shareable = false;
  RoutingExplanation x = explainRouting({std::nullopt, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_TRUE(x.routing.has_value()) << x.status.toString();
  EXPECT_EQ(x.routing->backend, BackendKind::kUcx);
  ASSERT_FALSE(x.decisions.empty());
  EXPECT_NE(x.decisions[0].reason.find("private memory"), std::string::npos)
      << x.decisions[0].reason;
  auto shm = resolveRouting({BackendKind::kShm, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_FALSE(shm.isOk());
  EXPECT_NE(shm.status().message().find("memory=private"), std::string::npos)
      << shm.status().toString();
  EXPECT_NE(shm.status().message().find("shareable"), std::string::npos);
  e.memory_shareable = true;
  auto back = resolveRouting({std::nullopt, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_TRUE(back.isOk());
  EXPECT_EQ(back->backend, BackendKind::kShm);
}

// CUDA device pools: auto picks cuda on one host and ucx (staged through host memory) across
// hosts, and says why; ucx asked by name is taken, the other host backends are refused naming
// the memory, and cuda is refused for host memory and across hosts.
TEST(Routing, DevicePoolsRouteToCudaOnOneHostUcxAcrossAndRefuseOtherHostBackends) {
  RoutingEnvironment e;
  e.ucx_compiled = true;
  e.memory_shareable = false;
  e.memory_device = true;
  RoutingExplanation x = explainRouting({std::nullopt, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_TRUE(x.routing.has_value()) << x.status.toString();
  EXPECT_EQ(x.routing->backend, BackendKind::kCuda);
  EXPECT_EQ(x.routing->state_layout, StateLayout::kPaged) << "one batched copy: records are cheap";
  EXPECT_NE(x.decisions[0].reason.find("CUDA device memory"), std::string::npos)
      << x.decisions[0].reason;
  for (BackendKind b : {BackendKind::kShm, BackendKind::kInproc}) {
    e.single_process = b == BackendKind::kInproc;
    auto r = resolveRouting({b, std::nullopt}, e, StateLayout::kPaged);
    ASSERT_FALSE(r.isOk()) << backendName(b);
    EXPECT_NE(r.status().message().find("memory=device"), std::string::npos)
        << r.status().toString();
    EXPECT_NE(r.status().message().find("it moves host memory"), std::string::npos)
        << r.status().toString();
  }
  e.single_process = false;
  auto ucx_here = resolveRouting({BackendKind::kUcx, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_TRUE(ucx_here.isOk()) << ucx_here.status().toString();
  EXPECT_EQ(ucx_here->backend, BackendKind::kUcx);
  e.peers_same_host = false;
  RoutingExplanation far = explainRouting({std::nullopt, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_TRUE(far.routing.has_value()) << far.status.toString();
  EXPECT_EQ(far.routing->backend, BackendKind::kUcx);
  EXPECT_NE(far.decisions[0].reason.find("staged through pinned host memory"), std::string::npos)
      << far.decisions[0].reason;
  e.ucx_compiled = false;
  auto none = resolveRouting({std::nullopt, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_FALSE(none.isOk());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find("ucx is not compiled in"), std::string::npos)
      << none.status().toString();
  e.ucx_compiled = true;
  auto cuda_far = resolveRouting({BackendKind::kCuda, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_FALSE(cuda_far.isOk());
  EXPECT_NE(cuda_far.status().message().find("every peer on this host"), std::string::npos);
  EXPECT_NE(cuda_far.status().message().find("device pools go by ucx"), std::string::npos);
  e.peers_same_host = true;
  e.memory_device = false;
  auto host = resolveRouting({BackendKind::kCuda, std::nullopt}, e, StateLayout::kPaged);
  ASSERT_FALSE(host.isOk());
  EXPECT_NE(host.status().message().find("it needs CUDA device pools"), std::string::npos)
      << host.status().toString();
  EXPECT_EQ(addressBackend("cuda:@hxfer-ctx-0"), BackendKind::kCuda);
}

}  // namespace
TEST(RoutingAddress, SchemesHostsAndLoopbackAreReadFromAddresses) {
  EXPECT_EQ(addressBackend("shm:@hxfer-context-1-0"), BackendKind::kShm);
  EXPECT_EQ(addressBackend("inproc:ctx0"), BackendKind::kInproc);
  EXPECT_EQ(addressBackend("ucx:10.0.0.1:7000"), BackendKind::kUcx);
  EXPECT_EQ(addressBackend("10.0.0.1:7000"), BackendKind::kUcx);
  EXPECT_EQ(addressBackend("hxfer-context"), std::nullopt);
  EXPECT_EQ(addressBackend("10.0.0.1:"), std::nullopt);
  EXPECT_EQ(addressBackend(":7000"), std::nullopt);
  EXPECT_EQ(addressHost("ucx:10.0.0.1:7000"), "10.0.0.1");
  EXPECT_EQ(addressHost("0.0.0.0:0"), "0.0.0.0");
  EXPECT_EQ(addressHost("ucx:[::1]:7000"), "::1");
  EXPECT_EQ(addressHost("shm:@x"), "");
  EXPECT_TRUE(isLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(isLoopbackHost("127.8.9.1"));
  EXPECT_TRUE(isLoopbackHost("::1"));
  EXPECT_TRUE(isLoopbackHost("localhost"));
  EXPECT_FALSE(isLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(isLoopbackHost("0.0.0.0"));
  EXPECT_TRUE(isLoopbackHost("0:0:0:0:0:0:0:1"));
  // A DNS name that starts like a loopback address may name any host.
  EXPECT_FALSE(isLoopbackHost("127.lab.example"));
  EXPECT_FALSE(isLoopbackHost("127.0.0.1.example"));
  EXPECT_FALSE(isLoopbackHost("128.0.0.1"));
  EXPECT_TRUE(isWildcardHost("0.0.0.0"));
  EXPECT_FALSE(isWildcardHost("10.0.0.1"));
}

}  // namespace hxfer::engine
