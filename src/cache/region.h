// Region: one contiguous, page-aligned block of host memory that pools live in and transports
// register. Allocated up front and pre-faulted (first touch runs at a fraction of memcpy speed),
// either anonymous or backed by a memfd so that the shm transport can hand it to a peer.
//
// RAII owner of the mapping (and the fd), neither copyable nor movable: hold it by unique_ptr
// so its address (and data()) stay put while transports have it registered. Not thread-safe
// for destruction; the bytes themselves are shared by whoever writes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace hxfer {

class Region {
 public:
  enum class Backing { kAnonymous, kMemfd };

  // Maps `length` bytes (rounded up to the page size; length 0 maps one page) and pre-faults
  // them. `name` labels the memfd (visible in /proc/PID/fd); a memfd is sealed at its size.
  // ResourceExhausted when the memory (or, for a memfd, the shmem space) cannot be had.
  static StatusOr<std::unique_ptr<Region>> allocate(uint32_t id, uint64_t length, Backing backing,
                                                    std::string_view name);
  // Maps a memfd received from a peer, shared and read-write. Takes ownership of `fd` (closed
  // on error too). PermissionDenied when the fd is not a memfd sealed against shrinking and
  // growing (allocate() seals its memfds); InvalidArgument when the file is shorter than
  // `length`. A sparse file is mapped without pre-faulting (it charges nothing until written).
  static StatusOr<std::unique_ptr<Region>> mapFd(uint32_t id, int fd, uint64_t length);

  // Wraps memory someone else owns (an engine's pool), without copying: the Region neither
  // unmaps `data` nor closes `fd` when destroyed. `fd` (-1: none) is a memfd whose offset 0 is
  // `data`, for the shm transport to hand to peers: PermissionDenied unless it is sealed
  // against shrinking and growing; InvalidArgument unless it holds `length` bytes and `data`
  // lies in a shared mapping of it at offset 0 (checked in /proc/self/maps). REQUIRES: `data`
  // stays mapped for `length` bytes while the Region lives.
  static StatusOr<std::unique_ptr<Region>> borrow(uint32_t id, uint8_t* data, uint64_t length,
                                                  int fd = -1);
  // Memory that `holder` owns (device memory of hxfer's own), kept while the Region lives:
  // the Region itself neither unmaps nor frees it.
  static std::unique_ptr<Region> holding(uint32_t id, uint8_t* data, uint64_t length,
                                         std::shared_ptr<void> holder);

  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  uint32_t id() const { return id_; }
  uint8_t* data() const { return data_; }
  uint64_t length() const { return length_; }  // the length asked for (not rounded)
  int fd() const { return fd_; }               // -1 for anonymous regions
  bool borrowed() const { return borrowed_; }  // borrow(): memory of someone else
  bool contains(uint64_t offset, uint64_t bytes) const {
    return offset <= length_ && bytes <= length_ - offset;
  }

 private:
  Region(uint32_t id, uint8_t* data, uint64_t length, uint64_t mapped, int fd,
         bool borrowed = false)
      : id_(id), data_(data), length_(length), mapped_(mapped), fd_(fd), borrowed_(borrowed) {}

  uint32_t id_;
  uint8_t* data_;
  uint64_t length_;
  uint64_t mapped_;
  int fd_;
  bool borrowed_;
  std::shared_ptr<void> holder_;  // holding(): what owns the memory
};

}  // namespace hxfer
