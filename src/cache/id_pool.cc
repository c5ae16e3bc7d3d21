#include "cache/id_pool.h"

#include <algorithm>
#include <string>

namespace hxfer {

IdPool::IdPool(uint32_t capacity) : capacity_(capacity), free_(capacity) {
  if (capacity > 0) runs_.emplace(0, capacity);
}

bool IdPool::isFree(uint32_t id) const {
  auto it = runs_.upper_bound(id);
  if (it == runs_.begin()) return false;
  --it;
  return id - it->first < it->second;
}

StatusOr<std::vector<uint32_t>> IdPool::take(uint32_t n) {
  if (n > free_) {
    return ResourceExhausted("need " + std::to_string(n) + " ids, " + std::to_string(free_) +
                             " of " + std::to_string(capacity_) + " free");
  }
  std::vector<uint32_t> out;
  out.reserve(n);
  if (n == 0) return out;
  for (auto it = runs_.begin(); it != runs_.end(); ++it) {
    if (it->second < n) continue;
    // First fit: take the head of the run, keep the tail.
    const uint32_t first = it->first;
    const uint32_t rest = it->second - n;
    runs_.erase(it);
    if (rest > 0) runs_.emplace(first + n, rest);
    for (uint32_t i = 0; i < n; ++i) out.push_back(first + i);
    free_ -= n;
    return out;
  }
  // No run is long enough: the lowest ids, whole runs from the front.
  while (out.size() < n) {
    auto it = runs_.begin();
    const uint32_t want = n - static_cast<uint32_t>(out.size());
    const uint32_t got = std::min(want, it->second);
    for (uint32_t i = 0; i < got; ++i) out.push_back(it->first + i);
    const uint32_t first = it->first, length = it->second;
    runs_.erase(it);
    if (got < length) runs_.emplace(first + got, length - got);
  }
  free_ -= n;
  return out;
}

StatusOr<std::vector<uint32_t>> IdPool::sortedIds(std::span<const uint32_t> ids, bool free,
                                                  std::string_view twice) const {
  std::vector<uint32_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const std::string id = "id " + std::to_string(sorted[i]);
    if (sorted[i] >= capacity_) {
      return InvalidArgument(id + " >= capacity " + std::to_string(capacity_));
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) return InvalidArgument(id + " " + std::string(twice));
    if (isFree(sorted[i]) != free) {
      return InvalidArgument(id + (free ? " is not free" : " is already free"));
    }
  }
  return sorted;
}

Status IdPool::takeIds(std::span<const uint32_t> ids) {
  ASSIGN_OR_RETURN(std::vector<uint32_t> sorted, sortedIds(ids, true, "listed twice"));
  for (uint32_t id : sorted) {
    // The run holding `id` (isFree above): split it around the id.
    auto it = std::prev(runs_.upper_bound(id));
    const uint32_t first = it->first, length = it->second;
    runs_.erase(it);
    if (id > first) runs_.emplace(first, id - first);
    if (id + 1 < first + length) runs_.emplace(id + 1, first + length - id - 1);
  }
  free_ -= static_cast<uint32_t>(sorted.size());
  return OkStatus();
}

Status IdPool::give(std::span<const uint32_t> ids) {
  ASSIGN_OR_RETURN(std::vector<uint32_t> sorted, sortedIds(ids, false, "given twice"));
  // Insert run by run, merging with the neighbours.
  for (size_t i = 0; i < sorted.size();) {
    uint32_t first = sorted[i];
    uint32_t length = 1;
    while (i + length < sorted.size() && sorted[i + length] == first + length) ++length;
    i += length;
    auto next = runs_.lower_bound(first);
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == first) {
        first = prev->first;
        length += prev->second;
        runs_.erase(prev);
      }
    }
    if (next != runs_.end() && next->first == first + length) {
      length += next->second;
      runs_.erase(next);
    }
    runs_.emplace(first, length);
  }
  free_ += static_cast<uint32_t>(sorted.size());
  return OkStatus();
}

}  // namespace hxfer
