#include "cache/record_layout.h"

#include <algorithm>
#include <set>

namespace hxfer {

const RecordDim* RecordLayout::find(std::string_view name) const {
  for (const RecordDim& d : dims) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

uint64_t RecordLayout::sizeOf(std::string_view name) const {
  uint64_t n = 0;
  for (const RecordDim& d : dims) {
    if (d.name == name) n = (n == 0 ? 1 : n) * d.size;
  }
  return n;
}

uint64_t RecordLayout::span() const {
  uint64_t end = element_bytes;
  for (const RecordDim& d : dims) {
    if (d.size > 1) end += uint64_t{d.size - 1} * d.stride;
  }
  return end;
}

std::string RecordLayout::toString() const {
  std::string out;
  for (const RecordDim& d : dims) {
    if (!out.empty()) out += ", ";
    out += d.name + " " + std::to_string(d.size) + " @" + std::to_string(d.stride);
  }
  return out + " (element " + std::to_string(element_bytes) + " B)";
}

LogicalDims logicalDims(LayerKind kind, Role role) {
  if (role == Role::kKv) return {"kv", "head", {"token", "dim"}};
  if (role == Role::kConv) return {"", "channel", {"window"}};
  switch (kind) {
    case LayerKind::kMamba2:
      return {"", "head", {"head_dim", "state"}};
    case LayerKind::kGdn:
      return {"", "head", {"key", "value"}};
    default:
      return {"", "channel", {"state"}};
  }
}

std::vector<uint32_t> innerSizes(const ModelSpec& model, const LayerSpec& layer, Role role) {
  if (role == Role::kKv) {
    return {model.tokens_per_block, layer.attention ? layer.attention->head_dim : 0};
  }
  switch (layer.recurrent) {
    case LayerKind::kMamba2:
      if (role == Role::kConv) return {layer.mamba2.d_conv - 1};
      return {layer.mamba2.head_dim, layer.mamba2.d_state};
    case LayerKind::kGdn:
      if (role == Role::kConv) return {layer.gdn.d_conv - 1};
      return {layer.gdn.k_head_dim, layer.gdn.v_head_dim};
    case LayerKind::kMamba1:
      if (role == Role::kConv) return {layer.mamba1.d_conv - 1};
      return {layer.mamba1.d_state};
    default:
      return {};
  }
}

StatusOr<uint32_t> unitLength(const Section& s, uint32_t element_bytes,
                              const std::vector<uint32_t>& inner_sizes) {
  uint64_t per = element_bytes;
  for (uint32_t n : inner_sizes) per *= n;
  if (per == 0 || s.unit_bytes % per != 0 || s.unit_bytes / per > UINT32_MAX) {
    return InvalidArgument("section " + s.name + ": unit of " + std::to_string(s.unit_bytes) +
                           " bytes is not a whole number of " + std::to_string(per) +
                           "-byte rows of the inner dims");
  }
  return static_cast<uint32_t>(s.unit_bytes / per);
}

StatusOr<std::vector<uint32_t>> localUnitCounts(const std::vector<Section>& sections, uint32_t tp,
                                                uint32_t tp_rank) {
  std::vector<uint32_t> out;
  for (const Section& s : sections) {
    ASSIGN_OR_RETURN(UnitRange r, shardUnits(s.units, tp, tp_rank, s.name));
    out.push_back(r.count);
  }
  return out;
}

std::vector<uint32_t> innerSizesOf(const RecordLayout& r, const LogicalDims& dims) {
  std::vector<uint32_t> out;
  for (const std::string& n : dims.inner) out.push_back(static_cast<uint32_t>(r.sizeOf(n)));
  return out;
}

Status checkRecordLayout(const RecordLayout& r, LayerKind kind, Role role,
                         const std::vector<Section>& sections, uint32_t tp, uint32_t tp_rank,
                         uint32_t element_bytes, uint32_t tokens_per_block) {
  if (r.element_bytes != element_bytes) {
    return InvalidArgument("record element_bytes=" + std::to_string(r.element_bytes) + " but the " +
                           std::string(roleName(role)) + " dtype has " +
                           std::to_string(element_bytes));
  }
  LogicalDims want = logicalDims(kind, role);
  // A view holding one section (K alone) may leave the section dim out.
  if (!want.section_dim.empty() && sections.size() == 1 && !r.find(want.section_dim)) {
    want.section_dim.clear();
  }
  std::set<std::string> expected(want.inner.begin(), want.inner.end());
  expected.insert(want.unit_dim);
  if (!want.section_dim.empty()) expected.insert(want.section_dim);
  std::set<std::string> names;
  for (const RecordDim& d : r.dims) {
    if (!expected.count(d.name)) {
      return InvalidArgument("record dim " + d.name + " is not a dim of a " +
                             std::string(roleName(role)) + " record");
    }
    // Inner dims may be split (named again); the section and unit dims may not.
    if (!names.insert(d.name).second && (d.name == want.unit_dim || d.name == want.section_dim)) {
      return InvalidArgument("record dim " + d.name + " twice (only inner dims may be split)");
    }
    if (d.size == 0) return InvalidArgument("record dim " + d.name + " has size 0");
  }
  for (const std::string& n : want.inner) {
    if (r.sizeOf(n) > UINT32_MAX) {
      return InvalidArgument("record dim " + n + " is split into " + std::to_string(r.sizeOf(n)) +
                             " elements, more than 2^32 - 1");
    }
  }
  for (const std::string& n : expected) {
    if (!names.count(n)) {
      return InvalidArgument("record has no dim " + n + " (a " + std::string(roleName(role)) +
                             " record needs it)");
    }
  }
  const std::vector<uint32_t> inner = innerSizesOf(r, want);
  if (role == Role::kKv && r.sizeOf("token") != tokens_per_block) {
    return InvalidArgument("record dim token has size " + std::to_string(r.sizeOf("token")) +
                           ", tokens_per_block=" + std::to_string(tokens_per_block));
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> local, localUnitCounts(sections, tp, tp_rank));
  uint64_t along = 0;
  for (size_t i = 0; i < sections.size(); ++i) {
    ASSIGN_OR_RETURN(uint32_t len, unitLength(sections[i], element_bytes, inner));
    const uint64_t n = uint64_t{local[i]} * len;
    if (!want.section_dim.empty()) {
      if (i > 0 && n != along) {
        return InvalidArgument("sections along dim " + want.section_dim +
                               " hold different unit counts");
      }
      along = n;
    } else {
      along += n;
    }
  }
  if (!want.section_dim.empty() && r.find(want.section_dim)->size != sections.size()) {
    return InvalidArgument("record dim " + want.section_dim + " has size " +
                           std::to_string(r.find(want.section_dim)->size) + " for " +
                           std::to_string(sections.size()) + " sections");
  }
  if (r.find(want.unit_dim)->size != along) {
    return InvalidArgument("record dim " + want.unit_dim + " has size " +
                           std::to_string(r.find(want.unit_dim)->size) + " but the rank holds " +
                           std::to_string(along) + " along it");
  }
  // Strides nest: sorted by stride, each at least the extent of everything below it.
  std::vector<const RecordDim*> by_stride;
  for (const RecordDim& d : r.dims) {
    if (d.size > 1) by_stride.push_back(&d);
  }
  std::stable_sort(by_stride.begin(), by_stride.end(),
                   [](const RecordDim* a, const RecordDim* b) { return a->stride < b->stride; });
  uint64_t extent = element_bytes;
  for (const RecordDim* d : by_stride) {
    if (d->stride < extent) {
      return InvalidArgument("record dim " + d->name + " stride " + std::to_string(d->stride) +
                             " < " + std::to_string(extent) +
                             " bytes of the dims inside it: elements would overlap");
    }
    uint64_t grown = 0;
    if (__builtin_mul_overflow(uint64_t{d->size - 1}, d->stride, &grown) ||
        __builtin_add_overflow(grown, extent, &extent) || extent > (uint64_t{1} << 48)) {
      return InvalidArgument("record dim " + d->name + " runs past 2^48 bytes");
    }
  }
  return OkStatus();
}

StatusOr<RecordLayout> contiguousRecordLayout(LayerKind kind, Role role,
                                              const std::vector<Section>& sections,
                                              const std::vector<uint32_t>& local_units,
                                              uint32_t element_bytes,
                                              const std::vector<uint32_t>& inner_sizes,
                                              const std::vector<std::string>& order) {
  const LogicalDims want = logicalDims(kind, role);
  if (inner_sizes.size() != want.inner.size() || local_units.size() != sections.size()) {
    return InvalidArgument("record: sizes do not match the logical dims");
  }
  uint64_t along = 0;
  for (size_t i = 0; i < sections.size(); ++i) {
    ASSIGN_OR_RETURN(uint32_t len, unitLength(sections[i], element_bytes, inner_sizes));
    const uint64_t n = uint64_t{local_units[i]} * len;
    along = want.section_dim.empty() ? along + n : n;
  }
  auto sizeOf = [&](const std::string& name) -> StatusOr<uint32_t> {
    if (name == want.unit_dim) return static_cast<uint32_t>(along);
    if (name == want.section_dim) return static_cast<uint32_t>(sections.size());
    for (size_t i = 0; i < want.inner.size(); ++i) {
      if (want.inner[i] == name) return inner_sizes[i];
    }
    return InvalidArgument("record: " + name + " is not a dim of a " + std::string(roleName(role)) +
                           " record");
  };
  RecordLayout r;
  r.element_bytes = element_bytes;
  r.dims.resize(order.size());
  uint64_t stride = element_bytes;
  for (size_t i = order.size(); i-- > 0;) {
    ASSIGN_OR_RETURN(uint32_t n, sizeOf(order[i]));
    r.dims[i] = {order[i], n, stride};
    stride *= n;
  }
  return r;
}

StatusOr<RecordLayout> canonicalRecordLayout(LayerKind kind, Role role,
                                             const std::vector<Section>& sections,
                                             const std::vector<uint32_t>& local_units,
                                             uint32_t element_bytes,
                                             const std::vector<uint32_t>& inner_sizes) {
  const LogicalDims want = logicalDims(kind, role);
  std::vector<std::string> order;
  if (!want.section_dim.empty() && sections.size() > 1) order.push_back(want.section_dim);
  order.push_back(want.unit_dim);
  order.insert(order.end(), want.inner.begin(), want.inner.end());
  return contiguousRecordLayout(kind, role, sections, local_units, element_bytes, inner_sizes,
                                order);
}

SectionPlacement placeSection(const RecordLayout& r, const LogicalDims& dims,
                              const std::vector<Section>& sections,
                              const std::vector<uint32_t>& local_units, size_t section,
                              uint32_t unit_len) {
  SectionPlacement p;
  const uint64_t us = r.find(dims.unit_dim)->stride;
  p.unit_len = unit_len;
  p.unit_stride = uint64_t{unit_len} * us;
  p.within_stride = us;
  if (!dims.section_dim.empty() && r.find(dims.section_dim)) {
    p.base = section * r.find(dims.section_dim)->stride;
    return p;
  }
  // Sections run along the unit dim: this one starts after the earlier ones' local units.
  const std::vector<uint32_t> inner = innerSizesOf(r, dims);
  uint64_t before = 0;
  for (size_t i = 0; i < section; ++i) {
    before += uint64_t{local_units[i]} * unitLength(sections[i], r.element_bytes, inner).value();
  }
  p.base = before * us;
  return p;
}

namespace {

struct Digit {
  uint64_t size, stride;
};

// The dims named `name`, innermost first (the least significant digit first).
std::vector<Digit> digitsOf(const RecordLayout& r, std::string_view name) {
  std::vector<Digit> out;
  for (auto it = r.dims.rbegin(); it != r.dims.rend(); ++it) {
    if (it->name == name) out.push_back({it->size, it->stride});
  }
  return out;
}

}  // namespace

StatusOr<std::vector<BoxDim>> logicalBox(const RecordLayout& a, const RecordLayout& b,
                                         std::string_view name) {
  std::vector<Digit> da = digitsOf(a, name), db = digitsOf(b, name);
  std::vector<BoxDim> inner_first;
  size_t i = 0, j = 0;
  while (i < da.size() && j < db.size()) {
    Digit& x = da[i];
    Digit& y = db[j];
    const uint64_t f = std::min(x.size, y.size);
    if (f == 0 || x.size % f != 0 || y.size % f != 0) {
      auto text = [&](const RecordLayout& r) {
        std::string t;
        for (const RecordDim& d : r.dims) {
          if (d.name == name) t += (t.empty() ? "" : " x ") + std::to_string(d.size);
        }
        return "[" + t + "]";
      };
      return Incompatible("record dim " + std::string(name) + " is split as " + text(a) +
                          " on one side and " + text(b) + " on the other: no common refinement");
    }
    inner_first.push_back({f, x.stride, y.stride});
    // The rest of a digit is its upper part: f times fewer values, f times the stride.
    for (Digit* d : {&x, &y}) {
      d->size /= f;
      d->stride *= f;
    }
    if (x.size == 1) ++i;
    if (y.size == 1) ++j;
  }
  if (i != da.size() || j != db.size()) {
    return Incompatible("record dim " + std::string(name) + " has another size on each side");
  }
  return std::vector<BoxDim>(inner_first.rbegin(), inner_first.rend());
}

std::vector<BoxDim> inBOrder(std::vector<BoxDim> dims) {
  std::erase_if(dims, [](const BoxDim& d) { return d.size == 1; });
  // b's memory order: outermost (largest b stride) first.
  std::stable_sort(dims.begin(), dims.end(), [](const BoxDim& x, const BoxDim& y) {
    return x.b_stride != y.b_stride ? x.b_stride > y.b_stride : x.a_stride > y.a_stride;
  });
  return dims;
}

namespace {

// Merges the innermost dims contiguous on both sides into the run; returns its length (0 for
// an empty box) and leaves the dims to walk. REQUIRES: dims in b's order (inBOrder).
uint64_t mergeRun(std::vector<BoxDim>& dims, uint64_t element_bytes) {
  uint64_t run = element_bytes;
  while (!dims.empty() && dims.back().a_stride == run && dims.back().b_stride == run) {
    run *= dims.back().size;
    dims.pop_back();
  }
  return run;
}

bool emptyBox(const std::vector<BoxDim>& dims) {
  return std::any_of(dims.begin(), dims.end(), [](const BoxDim& d) { return d.size == 0; });
}

}  // namespace

uint64_t runBytes(std::vector<BoxDim> dims, uint64_t element_bytes) {
  if (emptyBox(dims)) return 0;
  dims = inBOrder(std::move(dims));
  return mergeRun(dims, element_bytes);
}

uint64_t forEachRun(std::vector<BoxDim> dims, uint64_t element_bytes, uint64_t a_base,
                    uint64_t b_base, const std::function<void(uint64_t, uint64_t, uint64_t)>& fn) {
  if (emptyBox(dims)) return 0;
  dims = inBOrder(std::move(dims));
  const uint64_t run = mergeRun(dims, element_bytes);
  std::vector<uint64_t> at(dims.size(), 0);
  while (true) {
    uint64_t a = a_base, b = b_base;
    for (size_t i = 0; i < dims.size(); ++i) {
      a += at[i] * dims[i].a_stride;
      b += at[i] * dims[i].b_stride;
    }
    fn(a, b, run);
    size_t i = dims.size();
    while (i > 0 && ++at[i - 1] == dims[i - 1].size) at[--i] = 0;
    if (i == 0) break;
  }
  return run;
}

}  // namespace hxfer
