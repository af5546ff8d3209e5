// A shared-memory window among the processes of one host: a header of per-rank signal
// counters and pids, then one slot per rank. Ranks write their own slot and read any.
//
// Signalling: each rank owns a monotonically increasing counter; post() increments it and
// wakes sleepers (a futex on a shared epoch word). Waiters poll for a while, yielding the
// core (ranks may outnumber cores), then sleep on the futex. While waiting they check
// the deadline, the abort flag and whether the ranks they wait for are still alive
// (pidfd, else kill(pid, 0) and /proc state), so a dead peer is named within
// milliseconds instead of at the timeout.
//
// Lifetime: rank 0 creates the POSIX shm object, every rank maps it, and rank 0 unlinks
// its name once all have attached, so nothing is left in /dev/shm even if a rank is
// killed later.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdx {
namespace transport {

// A window wait that reached its op's deadline (the group's timeout).
struct WindowTimedOut : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct WaitContext {
  std::chrono::steady_clock::time_point deadline;
  const std::atomic<bool>* aborted = nullptr;
  const char* what = "shared-memory op";  // for errors
  // Run at each of a stalled wait's checks (every 20 ms) when set, for each rank waited
  // for: throws to end the wait, as when that rank announced another way of running
  // this op (announce()).
  std::function<void(int rank)> check;
};

class HostWindow {
 public:
  // Creates (rank 0) or opens the shm object `name` sized for `size` slots of
  // `slotBytes`. `cpus`: how many of the window's ranks may run at once, one thread
  // each, which decides whether waiting polls first; `passThreads`: see passThreads().
  // Throws std::runtime_error on failure.
  static std::unique_ptr<HostWindow> open(const std::string& name, bool create, int rank,
                                          int size, size_t slotBytes, int cpus,
                                          int passThreads);
  ~HostWindow();
  HostWindow(const HostWindow&) = delete;
  HostWindow& operator=(const HostWindow&) = delete;

  // Removes the name (rank 0, once every rank has attached); the mapping stays valid.
  void unlinkName();
  // Opens a pidfd on every peer, once all have attached: a pid looked up only when a
  // wait first stalls could by then be another process's, if the rank died and its pid
  // was reused, and the wait would run to its deadline instead of naming the rank.
  void watchPeers();

  int rank() const {
    return rank_;
  }
  // Threads (this one and helpers) each of this rank's memory passes may be split over,
  // as the group decided (Placement::passThreads).
  int passThreads() const {
    return passThreads_;
  }
  int size() const {
    return size_;
  }
  size_t halfBytes() const {
    return slotBytes_ / 2;
  }
  // Half h (0 or 1) of rank r's slot.
  char* half(int r, int h) const;

  // Signals: bump this rank's counter and wake sleepers.
  void post();
  uint64_t posted() const;
  // Blocks until every rank's counter (or rank r's) reaches `target`.
  void waitAll(uint64_t target, const WaitContext& wc);
  void waitRank(int r, uint64_t target, const WaitContext& wc);
  // Whether rank r's counter has reached `target` already (no waiting, no checks). An
  // acquire load: when true, what r wrote before that post() is visible here.
  bool reached(int r, uint64_t target) const;

  // Alternating halves: the next half to use, waiting until every rank is done with its
  // previous use; release() marks the current counter as the point it is free again.
  int acquireHalf(const WaitContext& wc);
  void releaseHalf(int h);

  static constexpr size_t kOpDetailBytes = 24;  // setOpDetail's text, NUL included
  // What a rank called, published with the first chunk of each op in the half it uses
  // (valid until every rank has released that half), so ranks that called different
  // ops or sizes find out at their first signal instead of reading garbage.
  struct OpInfo {
    uint64_t kind = 0;
    int64_t root = -1;
    uint64_t bytes = 0;
    uint64_t address = 0;  // the rank's buffer, for algorithms that read it in place
    uint64_t seq = 0;      // the op's sequence number in its group (setOpSeq), stamped
    char detail[kOpDetailBytes] = {};  // setOpDetail's text, stamped; NUL-terminated
  };
  // Stamps `info` with the op sequence number and detail last set.
  void setOpInfo(int h, const OpInfo& info);
  // The group's sequence number of the op about to run: ranks that agree on kind and
  // size but not on which op this is (one skipped an op the others ran) are told apart.
  void setOpSeq(uint64_t seq) {
    opSeq_ = seq;
  }
  // What else ranks must agree on for the op about to run, as short text the caller
  // chooses (a reduction's dtype and reduce op: ranks that reduce the same bytes as
  // different types would each return garbage). Cut to kOpDetailBytes - 1 characters.
  void setOpDetail(const char* text);
  OpInfo opInfo(int r, int h) const;

  // What this rank runs now, for peers to read: ranks that run one op different ways
  // (one in this window, another on messages, as when they pinned different algorithms)
  // would otherwise each wait out the timeout for the other. `op` names the op (the
  // caller's number, of which the low kAnnouncedOpBits count) and `way` how this rank
  // runs it (nonzero, the caller's number too). One store to this rank's counter line,
  // which keeps the last kAnnouncements (one slot per op number modulo that): a rank
  // whose role never waits (a broadcast root) may have moved on to later ops by the
  // time a peer stalled on an earlier one reads its way for that one.
  static constexpr int kAnnouncedOpBits = 48;
  static constexpr uint64_t kAnnouncedOpMask = (uint64_t{1} << kAnnouncedOpBits) - 1;
  static constexpr int kAnnouncements = 7;
  void announce(uint64_t op, uint16_t way);
  // Rank r's announcement in slot i (0 .. kAnnouncements - 1): the op's low
  // kAnnouncedOpBits bits (compare `op & kAnnouncedOpMask`), and its way (0: none yet).
  struct Announced {
    uint64_t op;
    uint16_t way;
  };
  Announced announced(int r, int i) const;

  // Cross-memory attach (process_vm_readv): whether this rank can read every peer's
  // memory. probeCrossMemory() publishes a probe word (before the group's attach
  // agreement) and, once all have attached, tries each peer's; the group then decides
  // for all with setCrossMemory(). Yama's ptrace_scope or a seccomp filter can forbid it.
  void publishProbe();
  bool probeCrossMemory() const;
  void setCrossMemory(bool ok) {
    crossMemory_ = ok;
  }
  bool crossMemory() const {
    return crossMemory_;
  }
  // This rank gave up on the window (an op failed here: a mismatch it detected, a
  // timeout, an abort): ranks waiting for it fail at their next check, within about
  // 20 ms, naming it and `why`, instead of waiting out their timeout. Its group is
  // broken, so the window is not used again. Only the first reason is kept.
  void publishFailure(const std::string& why);

  // Copies `bytes` at `remote` in rank r's address space to `local`; throws naming r.
  void readFrom(int r, const void* remote, void* local, size_t bytes, const WaitContext& wc);
  // The same from any thread (helpers of a split pass): returns 0, or the errno that
  // stopped it (kNoProgress when the kernel copied nothing), for the caller's thread to
  // pass to readFailed(). Touches nothing of the window's own state.
  static constexpr int kNoProgress = -1;
  int tryReadFrom(int r, const void* remote, void* local, size_t bytes) const noexcept;
  // Throws for a read of rank r that tryReadFrom ended with `error`, naming every rank
  // that is gone when r has exited. Caller's thread only.
  [[noreturn]] void readFailed(int r, int error, const WaitContext& wc);

  // The default slot size (TDX_SHM_SLOT_BYTES).
  static size_t defaultSlotBytes();

 private:
  HostWindow() = default;
  struct Header;
  std::atomic<uint64_t>& counter(int r) const;
  // On the counter's line: slot i of rank r's announcements, each written once per op
  // by its rank (op number modulo kAnnouncements), read only by stalled waits.
  std::atomic<uint64_t>& announcement(int r, int i) const;
  // Bumps the futex word and wakes ranks sleeping on it (post(), publishFailure()).
  void wakeSleepers();
  OpInfo* opInfoSlot(int r, int h) const;
  struct FailureNotice {
    std::atomic<uint64_t> failed;  // 0 until the rank gives up; reason written before
    char reason[248];
  };
  FailureNotice* failureSlot(int r) const;
  // Throws naming `r` when that rank has published a failure.
  void checkFailed(int r, const WaitContext& wc) const;
  // Throws naming `r` when that rank's process has exited.
  void checkAlive(int r, const WaitContext& wc);
  bool exited(int r);
  // Until rank `only`'s counter (every other rank's when only < 0) reaches `target`.
  void waitFor(int only, uint64_t target, const WaitContext& wc);
  int32_t pid(int r) const;

  std::string name_;
  int rank_ = 0;
  int size_ = 0;
  size_t slotBytes_ = 0;
  size_t mapBytes_ = 0;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  char* slots_ = nullptr;
  bool unlinked_ = false;
  uint64_t posted_ = 0;
  int nextHalf_ = 0;
  uint64_t freeAt_[2] = {0, 0};
  std::vector<int> pidfds_;  // per rank; -1: not open, -2: unavailable, kExited
  static constexpr int kExited = -3;  // the rank was gone when its pidfd was opened
  int64_t spinUs_ = 0;
  int passThreads_ = 1;
  uint64_t opSeq_ = 0;
  char opDetail_[kOpDetailBytes] = {};
  bool crossMemory_ = false;
};

} // namespace transport
} // namespace tdx
