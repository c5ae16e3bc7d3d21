// Blocking TCP helpers for the benchmarks' raw-socket baselines (`hxfer bench transport` and the
// `hxfer bench` workloads): a loopback listener and loops that send or receive exactly n bytes.
// Header-only because src/cli/CMakeLists.txt compiles only the *_cmd.cc files into hxfer_cli.
// Thread-safety: no state; each call works on the descriptor it is given.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/status.h"

namespace hxfer::cli {

// Sends all `n` bytes (in chunks of at most 1 GiB, retrying on EINTR); false when the peer is
// gone or the socket fails. MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE.
inline bool sendAll(int fd, const uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::send(fd, p, std::min<uint64_t>(n, 1 << 30), MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

// Receives exactly `n` bytes; false on EOF or error before all of them arrived.
inline bool recvAll(int fd, uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, std::min<uint64_t>(n, 1 << 30), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

// A socket listening (backlog 1) on a port the kernel picks on 127.0.0.1; `addr` receives the
// address to connect to. The caller owns (and closes) the returned descriptor.
inline StatusOr<int> listenOnLoopback(sockaddr_in* addr) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  *addr = sockaddr_in{};
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(*addr);
  if (lfd < 0 || ::bind(lfd, reinterpret_cast<sockaddr*>(addr), len) != 0 ||
      ::listen(lfd, 1) != 0 || ::getsockname(lfd, reinterpret_cast<sockaddr*>(addr), &len) != 0) {
    const int err = errno;  // before close() may change it
    if (lfd >= 0) ::close(lfd);
    return Unavailable(std::string("tcp baseline listener: ") + std::strerror(err));
  }
  return lfd;
}

}  // namespace hxfer::cli
