// What a group's worker is doing now, for a caller whose wait(timeout) on a collective
// ran out: the op that runs (which may be one queued ahead of the caller's) and the rank
// its latest stalled wait was on. Written by the worker thread, read by any; works share
// it with their group, and may outlive the group.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace tdx {

struct RunningOp {
  // Where a stalled wait was.
  enum Where : int { kMessages = 0, kWindow = 1, kWindowSetup = 2 };

  std::atomic<uint64_t> seq{0};  // the running op's sequence number (0: none)
  // The group rank its latest stalled wait was on, times 4, plus where (-1: none yet):
  // one word, so a reader never pairs one stall's rank with another's place.
  std::atomic<int64_t> stall{-1};
  // The group's note mapping its ranks to global ranks ("" for the default group's).
  std::shared_ptr<const std::string> rankNote;

  void start(uint64_t s) {
    stall.store(-1, std::memory_order_relaxed);
    seq.store(s, std::memory_order_release);
  }
  void stalledOn(int rank, Where w) {
    stall.store(int64_t{rank} * 4 + w, std::memory_order_release);
  }
  // For the op `mine`, which has not completed: where it stands on this rank, as a
  // sentence ("" when the worker has moved on, or not stalled yet).
  std::string describeFor(uint64_t mine) const;
};

} // namespace tdx
