#include "transport/peer_memory/host_window.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "common/env.h"
#include "common/host.h"

namespace tdx {
namespace transport {

namespace {

constexpr uint64_t kMagic = 0x7464785f73686d31ull;  // "tdx_shm1"
constexpr size_t kLine = 64;

size_t roundUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

std::string sysError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

int pidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

// Exited, or a zombie nobody has reaped yet (kill(pid, 0) still succeeds for those).
bool processGone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

} // namespace

// The shared header. Counters sit on their own cache lines so one rank's post does not
// invalidate the line another rank polls.
struct HostWindow::Header {
  uint64_t magic;
  uint64_t size;
  uint64_t slotBytes;
  alignas(kLine) std::atomic<uint32_t> epoch;  // futex word
  std::atomic<uint32_t> sleepers;
  // Followed by: pids[size] (int32), then counters, one per line.
};

size_t HostWindow::defaultSlotBytes() {
  const int64_t v = env::getInt("TDX_SHM_SLOT_BYTES");
  // A window maps one slot per rank: near 2^64, size * slot would wrap and map less
  // than the slots' addresses reach (open() checks the product too). Read when a group
  // is created, so it fails there. A size merely too large for /dev/shm is left to fail
  // when the window is made, which costs the group its windows, not the job.
  constexpr int64_t kMost = int64_t{1} << 48;
  if (v > kMost) {
    throw std::invalid_argument("TDX_SHM_SLOT_BYTES=" + std::to_string(v) +
                                " is more than a slot may hold (2^48 bytes); unset it or "
                                "give a smaller size");
  }
  return roundUp(static_cast<size_t>(std::max<int64_t>(v, 8192)), 8192);
}

std::unique_ptr<HostWindow> HostWindow::open(const std::string& name, bool create, int rank,
                                             int size, size_t slotBytes, int cpus,
                                             int passThreads) {
  std::unique_ptr<HostWindow> w(new HostWindow());
  w->name_ = name;
  w->rank_ = rank;
  w->size_ = size;
  w->slotBytes_ = roundUp(slotBytes, 8192);
  // Header, pids, one counter line per rank, two op-info lines per rank, one failure
  // notice per rank.
  const size_t headerBytes = roundUp(sizeof(Header) + size * sizeof(int32_t), kLine) +
                             size * kLine + 2 * size * kLine + size * sizeof(FailureNotice);
  const size_t slotsOffset = roundUp(headerBytes, 4096);
  if (size > 0 && w->slotBytes_ > (std::numeric_limits<size_t>::max() - slotsOffset) / size) {
    throw std::invalid_argument("a window of " + std::to_string(size) + " slots of " +
                                std::to_string(w->slotBytes_) +
                                " bytes is larger than memory can address; lower "
                                "TDX_SHM_SLOT_BYTES");
  }
  w->mapBytes_ = slotsOffset + size * w->slotBytes_;

  const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sysError("shm_open " + name));
  if (create) {
    // Reserve every page now: a full /dev/shm then fails here as a clear error, instead
    // of as SIGBUS on first touch in the middle of an op.
    const bool sized = ftruncate(fd, static_cast<off_t>(w->mapBytes_)) == 0 &&
                       posix_fallocate(fd, 0, static_cast<off_t>(w->mapBytes_)) == 0;
    if (!sized) {
      ::close(fd);
      shm_unlink(name.c_str());
      throw std::runtime_error("cannot reserve " + std::to_string(w->mapBytes_) +
                               " bytes of shared memory for " + name +
                               " (is /dev/shm full? make it larger or set TDX_SHM=0)");
    }
  }
  void* p = mmap(nullptr, w->mapBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    throw std::runtime_error(sysError("mmap " + name));
  }
  w->base_ = static_cast<char*>(p);
  w->header_ = reinterpret_cast<Header*>(w->base_);
  w->slots_ = w->base_ + slotsOffset;
  if (create) {
    w->header_->magic = kMagic;
    w->header_->size = size;
    w->header_->slotBytes = w->slotBytes_;
  } else if (w->header_->magic != kMagic || w->header_->size != static_cast<uint64_t>(size)) {
    throw std::runtime_error("shared-memory window " + name + " has an unexpected layout");
  }
  auto* pids = reinterpret_cast<int32_t*>(w->base_ + sizeof(Header));
  pids[rank] = static_cast<int32_t>(getpid());
  w->pidfds_.assign(size, -1);
  // Polling pays only while every rank has a core of its own; when ranks outnumber the
  // CPUs they may run on together, a spinning rank steals the core a peer needs to reach
  // the signal it is waiting for, so it sleeps at once instead.
  const std::string spin = env::get("TDX_SHM_SPIN_US");
  if (spin == "auto") {
    w->spinUs_ = size <= cpus ? 100 : 0;
  } else {
    w->spinUs_ = env::getInt("TDX_SHM_SPIN_US");
  }
  w->passThreads_ = std::clamp(passThreads, 1, kMaxPassThreads);
  return w;
}

HostWindow::~HostWindow() {
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  if (base_ != nullptr) munmap(base_, mapBytes_);
  if (!unlinked_ && rank_ == 0) shm_unlink(name_.c_str());
}

void HostWindow::unlinkName() {
  if (!unlinked_) shm_unlink(name_.c_str());
  unlinked_ = true;
}

char* HostWindow::half(int r, int h) const {
  return slots_ + static_cast<size_t>(r) * slotBytes_ + static_cast<size_t>(h) * halfBytes();
}

std::atomic<uint64_t>& HostWindow::counter(int r) const {
  const size_t pidsEnd = roundUp(sizeof(Header) + size_ * sizeof(int32_t), kLine);
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + pidsEnd + r * kLine);
}

std::atomic<uint64_t>& HostWindow::announcement(int r, int i) const {
  static_assert((1 + kAnnouncements) * sizeof(std::atomic<uint64_t>) <= kLine,
                "the counter and its announcements fit one line");
  return *(&counter(r) + 1 + i);
}

// An announcement word: the op's low kAnnouncedOpBits bits above the way's 16.
void HostWindow::announce(uint64_t op, uint16_t way) {
  announcement(rank_, static_cast<int>(op % kAnnouncements))
      .store(((op & kAnnouncedOpMask) << 16) | way, std::memory_order_release);
}

HostWindow::Announced HostWindow::announced(int r, int i) const {
  const uint64_t word = announcement(r, i).load(std::memory_order_acquire);
  return Announced{word >> 16, static_cast<uint16_t>(word & 0xffff)};
}

int32_t HostWindow::pid(int r) const {
  return reinterpret_cast<const int32_t*>(base_ + sizeof(Header))[r];
}

HostWindow::OpInfo* HostWindow::opInfoSlot(int r, int h) const {
  const size_t countersEnd = roundUp(sizeof(Header) + size_ * sizeof(int32_t), kLine) +
                             size_ * kLine;
  static_assert(sizeof(OpInfo) <= kLine, "op info fits a line");
  return reinterpret_cast<OpInfo*>(base_ + countersEnd + (2 * r + h) * kLine);
}

HostWindow::FailureNotice* HostWindow::failureSlot(int r) const {
  // The notices follow the op-info lines: two per rank, the last at (size - 1, 1).
  char* opInfoEnd = reinterpret_cast<char*>(opInfoSlot(size_ - 1, 1)) + kLine;
  return reinterpret_cast<FailureNotice*>(opInfoEnd + r * sizeof(FailureNotice));
}

void HostWindow::publishFailure(const std::string& why) {
  FailureNotice* n = failureSlot(rank_);
  if (n->failed.load(std::memory_order_acquire) != 0) return;  // the first reason stays
  const size_t len = std::min(why.size(), sizeof(n->reason) - 1);
  std::memcpy(n->reason, why.data(), len);
  n->reason[len] = '\0';
  n->failed.store(1, std::memory_order_seq_cst);
  wakeSleepers();  // they look at notices between sleeps
}

void HostWindow::checkFailed(int r, const WaitContext& wc) const {
  const FailureNotice* n = failureSlot(r);
  if (n->failed.load(std::memory_order_acquire) == 0) return;
  char reason[sizeof(n->reason)];
  std::memcpy(reason, n->reason, sizeof(reason));
  reason[sizeof(reason) - 1] = '\0';
  throw std::runtime_error("rank " + std::to_string(r) + " gave up on the group's shared-memory "
                           "ops while this rank waited for it in " + wc.what + ": " + reason);
}

void HostWindow::setOpInfo(int h, const OpInfo& info) {
  // Published by the post() that follows (a seq_cst store of the counter).
  OpInfo stamped = info;
  stamped.seq = opSeq_;
  std::memcpy(stamped.detail, opDetail_, sizeof(opDetail_));
  *opInfoSlot(rank_, h) = stamped;
}

void HostWindow::setOpDetail(const char* text) {
  std::strncpy(opDetail_, text, sizeof(opDetail_) - 1);
  opDetail_[sizeof(opDetail_) - 1] = '\0';
}

HostWindow::OpInfo HostWindow::opInfo(int r, int h) const {
  return *opInfoSlot(r, h);
}

namespace {
constexpr uint64_t kProbeMagic = 0x7464785f636d6121ull;  // "tdx_cma!"
const volatile uint64_t kProbeWord = kProbeMagic;
} // namespace

void HostWindow::publishProbe() {
  OpInfo info;
  info.address = reinterpret_cast<uint64_t>(&kProbeWord);
  setOpInfo(0, info);
}

bool HostWindow::probeCrossMemory() const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    uint64_t got = 0;
    iovec local{&got, sizeof(got)};
    iovec remote{reinterpret_cast<void*>(opInfo(r, 0).address), sizeof(got)};
    if (process_vm_readv(pid(r), &local, 1, &remote, 1, 0) != sizeof(got) || got != kProbeMagic) {
      return false;
    }
  }
  return true;
}

int HostWindow::tryReadFrom(int r, const void* remote, void* local, size_t bytes) const
    noexcept {
  size_t done = 0;
  while (done < bytes) {
    iovec l{static_cast<char*>(local) + done, bytes - done};
    iovec rm{const_cast<char*>(static_cast<const char*>(remote)) + done, bytes - done};
    const ssize_t n = process_vm_readv(pid(r), &l, 1, &rm, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return kNoProgress;
    done += static_cast<size_t>(n);
  }
  return 0;
}

void HostWindow::readFailed(int r, int error, const WaitContext& wc) {
  if (error == ESRCH) checkAlive(r, wc);  // names every rank that is gone
  throw std::runtime_error(std::string("reading rank ") + std::to_string(r) +
                           "'s buffer in place failed during " + wc.what + ": " +
                           (error == kNoProgress ? "no progress" : std::strerror(error)) +
                           (error == ESRCH ? " (that rank has exited)" : ""));
}

void HostWindow::readFrom(int r, const void* remote, void* local, size_t bytes,
                          const WaitContext& wc) {
  const int error = tryReadFrom(r, remote, local, bytes);
  if (error != 0) readFailed(r, error, wc);
}

void HostWindow::post() {
  counter(rank_).store(++posted_, std::memory_order_seq_cst);
  wakeSleepers();
}

void HostWindow::wakeSleepers() {
  header_->epoch.fetch_add(1, std::memory_order_seq_cst);
  if (header_->sleepers.load(std::memory_order_seq_cst) > 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->epoch), FUTEX_WAKE, INT32_MAX,
            nullptr, nullptr, 0);
  }
}

uint64_t HostWindow::posted() const {
  return posted_;
}

void HostWindow::watchPeers() {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) (void)exited(r);  // opens the pidfd while the pid is still the rank's
  }
}

bool HostWindow::exited(int r) {
  const pid_t process = pid(r);
  if (process <= 0) return false;
  if (pidfds_[r] == kExited) return true;
  if (pidfds_[r] == -1) {
    pidfds_[r] = pidfdOpen(process);
    if (pidfds_[r] < 0) {
      // Gone already: remembered, as the pid may belong to another process later.
      // Otherwise unavailable: fall back to /proc.
      pidfds_[r] = errno == ESRCH ? kExited : -2;
      if (pidfds_[r] == kExited) return true;
    }
  }
  if (pidfds_[r] >= 0) {
    pollfd pfd{pidfds_[r], POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
  }
  return processGone(process);
}

void HostWindow::checkAlive(int r, const WaitContext& wc) {
  if (!exited(r)) return;
  // Name every rank that is gone: the first to die need not be the one waited for (a
  // survivor that gave up on it may have exited since).
  std::string gone;
  int count = 0;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || (q != r && !exited(q))) continue;
    gone += std::string(count++ ? " and " : "") + "rank " + std::to_string(q) + " (pid " +
            std::to_string(pid(q)) + ")";
  }
  throw std::runtime_error(gone + " exited during " + wc.what +
                           " while this rank waited for rank " + std::to_string(r) +
                           " in shared memory");
}

void HostWindow::waitFor(int only, uint64_t target, const WaitContext& wc) {
  // The ranks waited for: `only`, or every other rank. Checked without allocating, as
  // this runs several times per chunk.
  auto waitedFor = [&](int r) { return only >= 0 ? r == only : r != rank_; };
  auto behind = [&](std::vector<int>* who) {
    bool any = false;
    for (int r = 0; r < size_; ++r) {
      if (waitedFor(r) && counter(r).load(std::memory_order_acquire) < target) {
        if (who == nullptr) return true;
        who->push_back(r);
        any = true;
      }
    }
    return any;
  };
  if (!behind(nullptr)) return;
  using Clock = std::chrono::steady_clock;
  const auto spinUntil = Clock::now() + std::chrono::microseconds(spinUs_);
  auto nextCheck = Clock::now() + std::chrono::milliseconds(20);
  for (;;) {
    if (!behind(nullptr)) return;
    const auto now = Clock::now();
    if (now >= nextCheck) {
      std::vector<int> who;
      behind(&who);
      // Exits first: a rank that gave up because another exited is only the messenger.
      for (int r : who) checkAlive(r, wc);
      for (int r : who) checkFailed(r, wc);
      if (wc.check) {
        for (int r : who) wc.check(r);
      }
      if (wc.aborted && wc.aborted->load()) {
        throw std::runtime_error(
            std::string("the process group was shut down (destroyed or aborted) during ") +
            wc.what);
      }
      if (now >= wc.deadline) {
        if (!behind(nullptr)) return;  // came just now
        std::string list;
        for (int r : who) list += (list.empty() ? "" : ", ") + std::to_string(r);
        // Every rank's counter is in the window, so the ranks this one did not wait for
        // (a step that waits for one peer) are judged too: all that got this far, and
        // all that did not, whoever this step needed.
        std::string arrived, behindNow;
        for (int r = 0; r < size_; ++r) {
          std::string& to = r == rank_ || reached(r, target) ? arrived : behindNow;
          to += (to.empty() ? "" : ", ") + std::to_string(r);
        }
        throw WindowTimedOut("timed out in " + std::string(wc.what) + " waiting for rank" +
                                 (who.size() > 1 ? "s " : " ") + list +
                                 " in shared memory (ranks that got this far: " + arrived +
                                 "; not: " + behindNow + "): those have not reached this op or "
                                 "are behind. Every rank must call the same collectives in "
                                 "the same order");
      }
      nextCheck = now + std::chrono::milliseconds(20);
    }
    if (now < spinUntil) {
      sched_yield();
      continue;
    }
    // Sleep until someone posts (or 10 ms pass, to run the checks above).
    const uint32_t seen = header_->epoch.load(std::memory_order_seq_cst);
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (behind(nullptr)) {
      timespec ts{0, 10 * 1000 * 1000};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->epoch), FUTEX_WAIT, seen, &ts,
              nullptr, 0);
    }
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void HostWindow::waitAll(uint64_t target, const WaitContext& wc) {
  waitFor(-1, target, wc);
}

void HostWindow::waitRank(int r, uint64_t target, const WaitContext& wc) {
  if (r != rank_) waitFor(r, target, wc);
}

bool HostWindow::reached(int r, uint64_t target) const {
  return counter(r).load(std::memory_order_acquire) >= target;
}

int HostWindow::acquireHalf(const WaitContext& wc) {
  const int h = nextHalf_;
  nextHalf_ ^= 1;
  waitAll(freeAt_[h], wc);
  return h;
}

void HostWindow::releaseHalf(int h) {
  freeAt_[h] = posted_;
}

} // namespace transport
} // namespace tdx
