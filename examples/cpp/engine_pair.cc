// Two engines in one process, each owning its pools: a context rank marks a request ready
// out of its own pages, a generation rank receives it into pages it chose itself, and every
// byte is compared. The pools come from hxfer::SharedBuffer, so `auto` picks the same-host
// shm path. With one slot and every block in the request, the request covers the whole pools
// of hxfer's own layout (no padding there), so the pools must end up identical.
#include <hxfer/hxfer.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <vector>

namespace {

int fail(const hxfer::Status& s, const char* what) {
  std::fprintf(stderr, "engine_pair: %s: %s\n", what, s.toString().c_str());
  return 1;
}

struct Engine {
  hxfer::Layout layout;
  std::map<std::string, std::shared_ptr<hxfer::SharedBuffer>> pools;
  hxfer::Memory memory;
};

hxfer::StatusOr<Engine> makeEngine(const hxfer::LayoutOptions& options) {
  auto layout = hxfer::Layout::engine(options);
  if (!layout.isOk()) return layout.status();
  std::map<std::string, std::shared_ptr<hxfer::SharedBuffer>> pools;
  std::map<std::string, hxfer::Buffer> buffers;
  for (const hxfer::PoolInfo& p : layout->pools()) {
    auto b = hxfer::SharedBuffer::allocate(p.bytes, p.name);
    if (!b.isOk()) return b.status();
    pools[p.name] = *b;
    buffers[p.name] = (*b)->buffer();
  }
  auto memory = hxfer::Memory::wrap(*layout, buffers);
  if (!memory.isOk()) return memory.status();
  return Engine{*layout, std::move(pools), *memory};
}

}  // namespace

int main() {
  hxfer::LayoutOptions o;
  o.engine = "hxfer";
  o.num_blocks = 8;
  o.num_slots = 1;
  auto ctx = makeEngine(o);
  if (!ctx.isOk()) return fail(ctx.status(), "context layout");
  auto gen = makeEngine(o);
  if (!gen.isOk()) return fail(gen.status(), "generation layout");

  uint8_t value = 1;
  for (auto& [name, pool] : ctx->pools) {
    auto* p = static_cast<uint8_t*>(pool->data());
    for (uint64_t i = 0; i < pool->bytes(); ++i) p[i] = value += 7;
  }

  hxfer::SenderOptions so;
  so.token = "example";
  auto tx = hxfer::Sender::create(ctx->layout, ctx->memory, so);
  if (!tx.isOk()) return fail(tx.status(), "sender");
  hxfer::ReceiverOptions ro;
  ro.token = "example";
  ro.peers = {(*tx)->address()};
  auto rx = hxfer::Receiver::create(gen->layout, gen->memory, ro);
  if (!rx.isOk()) return fail(rx.status(), "receiver");

  std::vector<uint32_t> ctx_blocks(o.num_blocks), gen_blocks(o.num_blocks);
  std::iota(ctx_blocks.begin(), ctx_blocks.end(), 0u);
  std::iota(gen_blocks.begin(), gen_blocks.end(), 0u);
  const uint32_t tokens = o.num_blocks * o.tokens_per_block;
  if (auto s = (*tx)->markReady(1, ctx_blocks, 0, "first-token"); !s.isOk()) {
    return fail(s, "markReady");
  }
  if (auto s = (*rx)->start(1, tokens, gen_blocks, 0); !s.isOk()) return fail(s, "start");
  auto r = (*rx)->wait(1, std::chrono::seconds(30));
  if (!r.isOk()) return fail(r.status(), "wait");
  if (!r->ok()) return fail(r->status, "request");
  for (auto& [name, pool] : ctx->pools) {
    if (std::memcmp(pool->data(), gen->pools[name]->data(), pool->bytes()) != 0) {
      std::fprintf(stderr, "engine_pair: pool %s differs\n", name.c_str());
      return 1;
    }
  }
  if (auto s = (*rx)->release(1); !s.isOk()) return fail(s, "release");
  std::printf("engine_pair: %llu bytes over %s, aux '%s', every byte equal\n",
              static_cast<unsigned long long>(r->bytes), (*rx)->backend().c_str(), r->aux.c_str());
  return 0;
}
