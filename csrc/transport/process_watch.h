// Knowing at once when a peer process on this host exits, without asking the network.
//
// UCX reports a dead peer only on endpoints in its peer-error mode, which its
// shared-memory transports cannot provide; such endpoints fall back to TCP loopback, and
// a process that listens on TCP can be reached by anyone on the network. A process on
// the same host can instead be watched directly: Linux hands out a pidfd for it that
// becomes readable when it exits. With that, same-host endpoints keep UCX's shared memory
// and still turn a kill -9 into an error at once.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace tdx {
namespace transport {

// Processes with equal keys can share POSIX shm and see each other's pids: same machine
// boot, same mount, IPC and pid namespaces.
std::string hostKey();

// Who a process is, as another process of the same host can check it. The start time
// tells a recycled pid from the process that first had it.
struct ProcessId {
  std::string host;        // hostKey()
  int64_t pid = 0;
  uint64_t startTime = 0;  // clock ticks after boot (/proc/<pid>/stat, field 22)

  static ProcessId self();
  std::string serialize() const;
  // Throws std::invalid_argument on bytes that serialize() did not write.
  static ProcessId parse(const std::string& bytes);
  bool sameHostAs(const ProcessId& other) const {
    return host == other.host;
  }
};

// The start time of a live process, or 0 when it is gone (or /proc does not say).
uint64_t processStartTime(int64_t pid);

// pidfds of watched processes in one epoll set, keyed by the caller's id.
class ProcessWatch {
 public:
  // Whether this kernel (and seccomp policy) lets a process take a pidfd.
  static bool supported();

  ProcessWatch();
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  // Watches `who` under `id`. False when it cannot (another host, or a kernel without
  // pidfd_open): the caller must find out about that peer some other way. A process that
  // is already gone is watched too, and reported by the next exited().
  bool watch(int id, const ProcessId& who);

  // Readable while some watched process has exited and not yet been reported (a process
  // found gone by watch() itself is not: only the next exited() reports it); -1 if the
  // watch could not start (then watch() always returns false).
  int fd() const {
    return epollFd_;
  }

  // The ids whose process exited since the last call, each reported once. Never blocks.
  std::vector<int> exited();

 private:
  int epollFd_ = -1;
  std::mutex mu_;
  std::unordered_map<int, int> pidfds_;  // id -> pidfd
  std::vector<int> gone_;                // ids found gone when watch() was called
};

} // namespace transport
} // namespace tdx
