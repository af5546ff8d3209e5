#include "c10d/RunningOp.hpp"

namespace tdx {

namespace {

const char* whereWords(int where) {
  switch (where) {
    case RunningOp::kWindow:
      return " in the shared-memory window";
    case RunningOp::kWindowSetup:
      return " to set up the shared-memory window";
    default:
      return " on messages";
  }
}

} // namespace

std::string RunningOp::describeFor(uint64_t mine) const {
  const uint64_t now = seq.load(std::memory_order_acquire);
  const int64_t word = stall.load(std::memory_order_acquire);
  // The worker may have moved on to the next op between the loads: its stall is not
  // this op's (the second load sees the move, as the stall was written after it).
  if (seq.load(std::memory_order_acquire) != now) return "";
  if (now == 0 || now > mine) return "";
  const std::string note = rankNote ? *rankNote : std::string();
  const std::string where =
      word < 0 ? std::string()
               : "a wait for rank " + std::to_string(word / 4) +
                     whereWords(static_cast<int>(word % 4));
  if (now == mine) {
    if (word < 0) return "";
    return " Its latest stall on this rank was " + where + note + ".";
  }
  // Ops of a group run one at a time in their order: this one waits for its turn.
  return " It has not started on this rank: op #" + std::to_string(now) +
         ", queued ahead of it, still runs" +
         (word < 0 ? std::string() : " (its latest stall: " + where + ")") + note + ".";
}

} // namespace tdx
