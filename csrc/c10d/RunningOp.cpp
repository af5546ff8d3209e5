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
  const int rank = waitingFor.load(std::memory_order_acquire);
  const int w = where.load(std::memory_order_relaxed);
  const std::string note = rankNote ? *rankNote : std::string();
  // The worker may move on between the loads: a wait read for another op is not named.
  if (now == mine) {
    if (rank < 0) return "";
    return " By then this rank was waiting for rank " + std::to_string(rank) +
           whereWords(w) + note + ".";
  }
  if (now == 0 || now > mine) return "";
  // Ops of a group run one at a time in their order: this one waits for its turn.
  return " It has not started on this rank: op #" + std::to_string(now) +
         ", queued ahead of it, still runs" +
         (rank < 0 ? std::string()
                   : ", waiting for rank " + std::to_string(rank) + whereWords(w)) +
         note + ".";
}

} // namespace tdx
