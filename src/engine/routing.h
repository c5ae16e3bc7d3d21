// Configuration resolution ("routing", DESIGN §8): turns what a user asked for (backend and
// state layout, each possibly `auto`) plus what is true of this build and this deployment into
// the effective backend and state layout, with a reason for every decision.
//
// Order (fixed, printed by `hxfer config --explain`):
//   1. backend: the requested one if compiled in and reachable; `auto` picks cuda when the pools
//      are CUDA device memory and every peer is on this host, shm when every peer is on this
//      host and the pools are shareable memory, else ucx. `auto` never picks inproc (tests and
//      single-process tools ask for it by name). Device pools have no path across hosts yet.
//   2. state layout, only once the backend is known: the requested one; `auto` honours the
//      model's preferred layout (hybrid models prefer paged) when the backend writes many small
//      records cheaply, and falls back to layer-major otherwise.
//   3. validation of the pair. A backend the deployment cannot use (shm with peers on another
//      host, inproc across processes) is an error naming the backend and the deployment. Paged
//      asked for by name on a backend where every record costs a message is honoured, with
//      the cost in the reason: the planner merges a paged slot into one op per slot, so the
//      pair is slower than layer-major there, never broken.
//
// Pure: no I/O, no threads. probeRoutingEnvironment() is the one function here that looks at
// the build; it does not touch the network.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache/layout.h"
#include "common/status.h"
#include "model/model.h"

namespace hxfer::engine {

enum class BackendKind : uint8_t { kInproc = 0, kShm = 1, kUcx = 2, kCuda = 3 };
std::string_view backendName(BackendKind b);  // "inproc", "shm", "ucx", "cuda"
// "auto" -> nullopt; otherwise a backend name. Errors name the value and the choices.
StatusOr<std::optional<BackendKind>> parseBackendRequest(std::string_view name);
// "auto" -> nullopt; otherwise parseStateLayout().
StatusOr<std::optional<StateLayout>> parseStateLayoutRequest(std::string_view name);

// The backend a transport address names: its scheme ("shm:", "ucx:", "inproc:", "cuda:", as
// Agent::localAddress gives it), or ucx for a bare "ip:port". nullopt when it names none.
std::optional<BackendKind> addressBackend(std::string_view address);
// The host of a ucx address ("ucx:10.0.0.2:5000" and "10.0.0.2:5000" -> "10.0.0.2"); empty for
// any other address.
std::string addressHost(std::string_view address);
// 127.0.0.0/8, ::1 (numeric addresses only) and "localhost": an address only this host reaches.
bool isLoopbackHost(std::string_view host);
// 0.0.0.0 or ::: every interface, reachable from nowhere as such.
bool isWildcardHost(std::string_view host);

// A context instance's addresses as a generation rank is given them: the backend they all
// name (nullopt for none given), each with its scheme ("ucx:" added to a bare ip:port), and
// the first host that is not this one (empty when all are loopback or shm/inproc).
struct PeerAddresses {
  std::optional<BackendKind> backend;
  std::vector<std::string> addresses;
  std::string remote_host;
};
// InvalidArgument naming the address: one that names no backend, or addresses that mix them.
StatusOr<PeerAddresses> resolvePeerAddresses(const std::vector<std::string>& peers);

// What the user asked for. nullopt = auto.
struct RoutingRequest {
  std::optional<BackendKind> backend;
  std::optional<StateLayout> state_layout;
};

// What is true of this build and this deployment.
struct RoutingEnvironment {
  bool inproc_compiled = true;
  bool shm_compiled = true;
  bool ucx_compiled = false;
  // The cuda transport is compiled into every build; it moves device memory where a device
  // runtime is (the CUDA one where the build has nvcc and the host a driver).
  bool cuda_compiled = true;
  // Every peer runs on this host (shm can reach it).
  bool peers_same_host = true;
  // The pools are shareable memory (memfd: hxfer's own pools, or engine pools taken from a
  // SharedBuffer or passed with an fd). Private engine memory cannot be handed to a peer, so
  // shm cannot reach it; ucx reaches it through its own paths.
  bool memory_shareable = true;
  // The pools are CUDA device memory: only the same-host cuda backend moves them (inproc,
  // shm and ucx move host memory).
  bool memory_device = false;
  // Every rank runs in this one process (inproc can reach it).
  bool single_process = false;
  // UCX writes many small records cheaply: it selected a transport with real one-sided RMA
  // (put). Where put is emulated (TCP, shared-memory emulation) every record costs a message.
  bool ucx_cheap_small_writes = false;
};

// The facts this build knows: which backends are compiled in. Deployment facts (same host,
// single process, UCX's transport choice) are left at their defaults for the caller to set.
RoutingEnvironment probeRoutingEnvironment();

// The layout a model's serving engine prefers for its recurrent state: paged for any model
// with recurrent layers (hybrid presets), none for attention-only models (the KV layout is the
// same either way).
std::optional<StateLayout> preferredStateLayout(const ModelSpec& model);

// Whether `backend` writes many small records cheaply in `env`.
bool cheapSmallWrites(BackendKind backend, const RoutingEnvironment& env);

// One printed line of `config --explain`.
struct RoutingDecision {
  std::string setting;  // "backend", "state_layout", "combination"
  std::string value;    // "shm", "paged", "ok"
  std::string reason;   // why, in words
};

struct Routing {
  BackendKind backend = BackendKind::kShm;
  StateLayout state_layout = StateLayout::kPaged;
};

// The decisions made so far and, when every step succeeded, the result. On failure `status`
// names both settings where a combination is impossible, and `decisions` holds the steps that
// were decided before it.
struct RoutingExplanation {
  std::vector<RoutingDecision> decisions;
  Status status;
  std::optional<Routing> routing;
};

RoutingExplanation explainRouting(const RoutingRequest& request, const RoutingEnvironment& env,
                                  std::optional<StateLayout> model_preference);

// explainRouting() without the reasons.
StatusOr<Routing> resolveRouting(const RoutingRequest& request, const RoutingEnvironment& env,
                                 std::optional<StateLayout> model_preference);

}  // namespace hxfer::engine
