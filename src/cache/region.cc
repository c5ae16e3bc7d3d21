#include "cache/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

namespace hxfer {
namespace {

// Rounds up to whole pages; false when that overflows (a length no mapping can hold).
bool roundToPage(uint64_t n, uint64_t* out) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (n == 0) n = 1;
  if (n > std::numeric_limits<uint64_t>::max() - (page - 1)) return false;
  *out = (n + page - 1) / page * page;
  return true;
}

std::string errnoText(std::string_view what, uint64_t length) {
  return std::string(what) + " of " + std::to_string(length) +
         " bytes failed: " + std::strerror(errno);
}

void prefault(uint8_t* data, uint64_t mapped) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  // MAP_POPULATE already faulted the pages in; writing one byte per page makes them private
  // and dirty so the first transfer pays no fault at all.
  for (uint64_t off = 0; off < mapped; off += page) data[off] = 0;
}

}  // namespace

StatusOr<std::unique_ptr<Region>> Region::allocate(uint32_t id, uint64_t length, Backing backing,
                                                   std::string_view name) {
  uint64_t mapped = 0;
  if (!roundToPage(length, &mapped) ||
      mapped > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return ResourceExhausted("region '" + std::string(name) + "' of " + std::to_string(length) +
                             " bytes is larger than any mapping");
  }
  int fd = -1;
  void* p = MAP_FAILED;
  if (backing == Backing::kMemfd) {
    fd = memfd_create(std::string(name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return ResourceExhausted(errnoText("memfd_create", length));
    // fallocate reserves the shmem pages now: a full tmpfs fails here with ENOSPC instead of
    // raising SIGBUS on the first touch below.
    // (Kernels without shmem fallocate say EOPNOTSUPP: fall back to touching the pages.)
    if (ftruncate(fd, static_cast<off_t>(mapped)) != 0 ||
        (fallocate(fd, 0, 0, static_cast<off_t>(mapped)) != 0 && errno != EOPNOTSUPP)) {
      Status s = ResourceExhausted(errnoText("sizing the memfd", length));
      close(fd);
      return s;
    }
    // Sealed at its size: a peer that maps it can neither shrink it (its writes would then
    // raise SIGBUS here) nor grow it, and nobody can remove the seals (mapFd checks them).
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      Status s = Internal(errnoText("sealing the memfd", length));
      close(fd);
      return s;
    }
    p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  } else {
    p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
             -1, 0);
  }
  if (p == MAP_FAILED) {
    Status s = ResourceExhausted(errnoText("mmap", length));
    if (fd >= 0) close(fd);
    return s;
  }
  auto* data = static_cast<uint8_t*>(p);
  prefault(data, mapped);
  return std::unique_ptr<Region>(new Region(id, data, length, mapped, fd));
}

StatusOr<std::unique_ptr<Region>> Region::mapFd(uint32_t id, int fd, uint64_t length) {
  auto refuse = [&](Status s) {
    close(fd);
    return s;
  };
  const std::string what = "region " + std::to_string(id) + " fd";
  // Only a memfd sealed against shrinking can be written without the risk of SIGBUS: a peer
  // that truncates its file under our copies would otherwise kill this process.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return refuse(PermissionDenied(
        what + " is not a sealable memfd (F_GET_SEALS: " + std::strerror(errno) + ")"));
  }
  if ((seals & F_SEAL_SHRINK) == 0 || (seals & F_SEAL_GROW) == 0) {
    return refuse(PermissionDenied(what + " is not sealed against shrinking and growing (seals=" +
                                   std::to_string(seals) + ")"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return refuse(InvalidArgument(errnoText("fstat of region fd", length)));
  if (static_cast<uint64_t>(st.st_size) < length) {
    return refuse(InvalidArgument(what + " holds " + std::to_string(st.st_size) +
                                  " bytes, peer announced " + std::to_string(length)));
  }
  uint64_t mapped = 0;
  if (!roundToPage(length, &mapped)) {
    return refuse(InvalidArgument(what + " length " + std::to_string(length) +
                                  " is larger than any mapping"));
  }
  // Pre-fault only a file whose pages all exist already (our allocator fallocates and touches
  // every page): populating then maps existing pages and costs no memory. A sparse file (a
  // hostile peer announcing a huge region) is mapped lazily, so it charges us nothing until a
  // write of ours touches a page.
  const bool allocated = static_cast<uint64_t>(st.st_blocks) * 512 >= mapped;
  const int flags = MAP_SHARED | (allocated ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (p == MAP_FAILED) return refuse(ResourceExhausted(errnoText("mmap of peer region", length)));
  return std::unique_ptr<Region>(new Region(id, static_cast<uint8_t*>(p), length, mapped, fd));
}

namespace {

// Whether `data` lies in a shared mapping of the file `st` describes, at file offset 0
// (/proc/self/maps: "start-end perms offset dev inode path").
bool mapsFdAtOffsetZero(const uint8_t* data, const struct stat& st) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  const auto addr = reinterpret_cast<uintptr_t>(data);
  char line[512];
  bool found = false;
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long start = 0, end = 0, offset = 0, inode = 0;
    char perms[8] = {};
    unsigned dev_major = 0, dev_minor = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu", &start, &end, perms, &offset, &dev_major,
                    &dev_minor, &inode) != 7) {
      continue;
    }
    if (addr < start || addr >= end) continue;
    found = perms[3] == 's' && inode == st.st_ino && offset + (addr - start) == 0;
    break;
  }
  std::fclose(maps);
  return found;
}

}  // namespace

StatusOr<std::unique_ptr<Region>> Region::borrow(uint32_t id, uint8_t* data, uint64_t length,
                                                 int fd) {
  const std::string what = "region " + std::to_string(id);
  if (data == nullptr && length != 0) return InvalidArgument(what + ": null buffer");
  if (fd >= 0) {
    const int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
      return PermissionDenied(what + ": fd " + std::to_string(fd) +
                              " is not a memfd sealed against shrinking and growing");
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < length) {
      return InvalidArgument(what + ": fd " + std::to_string(fd) + " holds " +
                             std::to_string(st.st_size) + " bytes, fewer than " +
                             std::to_string(length));
    }
    // Peers map the fd from offset 0: it must be the very memory at `data`, or their writes
    // would land somewhere the engine never reads.
    if (!mapsFdAtOffsetZero(data, st)) {
      return InvalidArgument(what + ": fd " + std::to_string(fd) +
                             " does not back the buffer (the buffer is not a mapping of it "
                             "from offset 0)");
    }
  }
  return std::unique_ptr<Region>(new Region(id, data, length, 0, fd, /*borrowed=*/true));
}

std::unique_ptr<Region> Region::holding(uint32_t id, uint8_t* data, uint64_t length,
                                        std::shared_ptr<void> holder) {
  std::unique_ptr<Region> r(new Region(id, data, length, 0, -1, /*borrowed=*/true));
  r->holder_ = std::move(holder);
  return r;
}

Region::~Region() {
  if (borrowed_) return;
  if (data_) munmap(data_, mapped_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace hxfer
