// RecentIds<V>: what a rank remembers about request ids that ended (a tombstone, the epoch of
// an answer it sent), each record for the same retention time and at most `capacity` records:
// when full, the oldest record goes first. A peer that makes the rank answer faster than
// records expire therefore costs bounded memory, and expiry costs O(expired), not a scan.
//
// Records are kept in insertion order, which is deadline order because every record is kept
// for the same time. put() of a known id replaces its record and restarts its time.
//
// Not thread-safe: the owner's lock guards it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>

namespace hxfer::engine {

template <typename V>
class RecentIds {
 public:
  using Clock = std::chrono::steady_clock;

  explicit RecentIds(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  void put(uint64_t id, V value, Clock::time_point until) {
    records_[id] = Record{std::move(value), until, ++serial_};
    order_.push_back({id, serial_});
    while (records_.size() > capacity_) popFront();
    // Replaced and erased records leave their order entry behind; compact when they dominate.
    if (order_.size() > 2 * records_.size() + 64) compact();
  }

  const V* find(uint64_t id) const {
    auto it = records_.find(id);
    return it == records_.end() ? nullptr : &it->second.value;
  }

  bool erase(uint64_t id) { return records_.erase(id) > 0; }

  // Drops every record whose time ended before `now`.
  void expire(Clock::time_point now) {
    while (!order_.empty()) {
      auto it = records_.find(order_.front().first);
      if (it != records_.end() && it->second.serial == order_.front().second &&
          it->second.until >= now) {
        return;
      }
      popFront();
    }
  }

  size_t size() const { return records_.size(); }

 private:
  struct Record {
    V value;
    Clock::time_point until;
    uint64_t serial = 0;  // which put() wrote it; matches exactly one order_ entry
  };

  // Removes the front order entry and, when it is still current, its record.
  void popFront() {
    const auto [id, serial] = order_.front();
    order_.pop_front();
    auto it = records_.find(id);
    if (it != records_.end() && it->second.serial == serial) records_.erase(it);
  }

  void compact() {
    std::deque<std::pair<uint64_t, uint64_t>> kept;
    for (const auto& entry : order_) {
      auto it = records_.find(entry.first);
      if (it != records_.end() && it->second.serial == entry.second) kept.push_back(entry);
    }
    order_ = std::move(kept);
  }

  size_t capacity_;
  uint64_t serial_ = 0;
  std::unordered_map<uint64_t, Record> records_;
  std::deque<std::pair<uint64_t, uint64_t>> order_;  // (id, serial), oldest first
};

}  // namespace hxfer::engine
