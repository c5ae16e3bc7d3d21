// Writes the fuzzers' seed corpus: valid encodings from the wire examples.
//   hxfer_fuzz_seeds DIR   ->  DIR/wire_message/<example>.bin   (frames of every message type)
//                              DIR/rank_info/<model>_tp<T>_pp<P>_r<R>_<layout>.bin
//                              DIR/rank_info/<model>_tp2_r1_<engine layout>.bin
// Deterministic: the same build writes the same files, so the checked-in corpus can be
// regenerated and diffed.
#include <cstdio>
#include <filesystem>
#include <string>

#include "wire/examples.h"
#include "wire/messages.h"
#include "wire/rank_info.h"

namespace {

using namespace hxfer;
using namespace hxfer::wire;

bool write(const std::filesystem::path& path, const Bytes& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  std::filesystem::create_directories(root / "wire_message");
  std::filesystem::create_directories(root / "rank_info");
  int files = 0;
  for (const auto& [name, m] : examples::messages()) {
    if (!write(root / "wire_message" / (name + ".bin"), encodeMessage(m))) return 1;
    ++files;
  }
  struct Shape {
    uint32_t tp, pp;
  };
  for (const ModelSpec& model : examples::models()) {
    for (Shape s : {Shape{1, 1}, Shape{2, 1}, Shape{4, 2}}) {
      for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
        const uint32_t rank = s.tp * s.pp - 1;
        auto info =
            examples::rankInfo(model, {s.tp, s.pp, {}}, rank, layout, InstanceRole::kContext);
        if (!info.isOk()) {
          std::fprintf(stderr, "%s: %s\n", model.name.c_str(), info.status().toString().c_str());
          return 1;
        }
        const std::string name = model.name + "_tp" + std::to_string(s.tp) + "_pp" +
                                 std::to_string(s.pp) + "_r" + std::to_string(rank) + "_" +
                                 std::string(stateLayoutName(layout));
        if (!write(root / "rank_info" / (name + ".bin"), encodeRankInfo(*info))) return 1;
        ++files;
      }
    }
  }
  // Every engine layout (described records, rank_info.records; id groups for vllm shared
  // tensors) at tp 2, rank 1.
  std::vector<EngineLayout> layouts = allEngineLayouts();
  for (const EngineLayout& e : sharedEngineLayouts()) layouts.push_back(e);
  for (const ModelSpec& model : examples::models()) {
    for (const EngineLayout& e : layouts) {
      if (e.engine == Engine::kHxfer) continue;  // above
      auto info = examples::rankInfo(model, {2, 1, {}}, 1, e, InstanceRole::kGeneration);
      if (!info.isOk()) {
        std::fprintf(stderr, "%s %s: %s\n", model.name.c_str(), e.toString().c_str(),
                     info.status().toString().c_str());
        return 1;
      }
      std::string name = model.name + "_tp2_r1_" + e.toString();
      for (char& c : name) {
        if (c == '(' || c == ')' || c == ',' || c == '=') c = '_';
      }
      if (!write(root / "rank_info" / (name + ".bin"), encodeRankInfo(*info))) return 1;
      ++files;
    }
  }
  std::printf("wrote %d seed files under %s\n", files, root.c_str());
  return 0;
}
