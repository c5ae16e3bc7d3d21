// Helpers both sides of the transceiver share: building the RankInfo a rank publishes, the
// "shape only" layouts used to work out which ranks of the other instance overlap this one,
// the end-to-end checksum of a request part, and the incarnation a rank says in its Hello.
//
// Pure functions except checksumOps, which reads caller-owned memory, and newIncarnation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/layout.h"
#include "common/status.h"
#include "device/device_api.h"
#include "model/model.h"
#include "plan/memory.h"
#include "plan/planner.h"
#include "wire/rank_info.h"

namespace hxfer::engine {

inline constexpr uint64_t kMaxOverlapCandidates = 4096;

// The layout of rank (tp_rank, pp_rank) of an instance with one block and one slot where the
// rank has attention / recurrent layers: enough to plan which ranks overlap, since a plan's
// unit and layer mapping does not depend on capacities.
StatusOr<RankLayout> shapeLayout(const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank,
                                 uint32_t pp_rank, StateLayout state_layout);

// Global ranks (pp_rank * tp + tp_rank) of the context instance `ctx_pc` that write anything to
// generation rank `gen` (the peers it must contact), ascending.
StatusOr<std::vector<uint32_t>> overlappingContextRanks(const ModelSpec& model,
                                                        const ParallelConfig& ctx_pc,
                                                        const RankLayout& gen);

// Global ranks of the generation instance that `ctx` writes anything to (the ranks that will
// ask it for every request), ascending. `gen_any` is one rank of that instance (its RankInfo
// layout): tp, pp, stage split and state layout come from it. One plan per rank on the stages
// that overlap ctx's layers, at most kMaxOverlapCandidates of them (ResourceExhausted past it):
// a context rank works this out once per generation peer, at its Hello.
StatusOr<std::vector<uint32_t>> overlappingGenerationRanks(const ModelSpec& model,
                                                           const RankLayout& ctx,
                                                           const RankLayout& gen_any);

// xxh3-64 over the bytes the ops move, in destination order (sorted by dst region, offset), so
// that both sides hash the same byte stream however the ops were split or merged. `source`:
// hash the source bytes in `mem` (the context side, before posting); otherwise the destination
// bytes (the generation side, after the Done). A source of kScratchRegion reads `scratch`.
StatusOr<uint64_t> checksumOps(std::vector<CopyOp> ops, const RankMemory& mem, bool source,
                               std::span<const uint8_t> scratch = {});

// The ordinal of the device whose memory `cache`'s pools are, by `device` (null: none), or -1
// for pools in host memory.
int deviceOrdinal(device::DeviceApi* device, const HybridCacheManager& cache);

// Refuses checksums (`checksum` asked) over pools in device memory (`device_memory`, of the
// `agent` named): checksumOps reads the pools on the host.
Status checksumsPossible(bool checksum, bool device_memory, const std::string& agent);

// The memory of a cache manager's regions, indexed by region id.
RankMemory cacheMemory(const HybridCacheManager& cache);

std::string rankName(const RankLayout& layout);  // "(tp 1, pp 0)"

// A random, non-zero incarnation for a sender or receiver being created (std::random_device,
// the kernel's generator): a rank restarted at the same address says another one.
uint64_t newIncarnation();

// The instance name a rank goes by: `given`, or when empty one unique to this process
// ("<role>-<host>-<pid>-<random>"), so that two unnamed instances never pass for one (a context
// rank holds each request id for one generation instance, and keeps one connection per rank of
// it). The ranks of an instance must share its name: with `ranks` > 1 an empty `given` is
// InvalidArgument naming `field`.
StatusOr<std::string> instanceName(const std::string& given, std::string_view role, uint64_t ranks,
                                   std::string_view field);

}  // namespace hxfer::engine
