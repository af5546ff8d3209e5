#include "parallel/staleness_clock.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace tdx::parallel {

StalenessClock::StalenessClock(int64_t workers, int64_t maxStaleness)
    : maxStaleness_(maxStaleness < 0 ? -1 : maxStaleness), open_(workers) {
  if (workers < 1) {
    throw std::invalid_argument("StalenessClock: a parameter server needs at least one "
                                "worker, not " + std::to_string(workers));
  }
  clock_.assign(workers, 0);
  held_.assign(workers, false);
  closed_.assign(workers, false);
}

void StalenessClock::checkWorker(int64_t worker, const char* what) const {
  if (worker < 0 || worker >= workers()) {
    throw std::invalid_argument(std::string("StalenessClock: ") + what + " names worker " +
                                std::to_string(worker) + ", outside [0, " +
                                std::to_string(workers()) + ")");
  }
}

int64_t StalenessClock::clock(int64_t worker) const {
  checkWorker(worker, "clock");
  return clock_[worker];
}

bool StalenessClock::held(int64_t worker) const {
  checkWorker(worker, "held");
  return held_[worker];
}

bool StalenessClock::closed(int64_t worker) const {
  checkWorker(worker, "closed");
  return closed_[worker];
}

int64_t StalenessClock::minClock() const {
  int64_t lo = -1;
  int64_t hi = 0;
  for (int64_t w = 0; w < workers(); ++w) {
    hi = std::max(hi, clock_[w]);
    if (!closed_[w] && (lo < 0 || clock_[w] < lo)) lo = clock_[w];
  }
  return lo < 0 ? hi : lo;
}

bool StalenessClock::mayGo(int64_t worker) const {
  return maxStaleness_ < 0 || clock_[worker] - minClock() <= maxStaleness_;
}

std::vector<int64_t> StalenessClock::releaseHeld() {
  // The minimum only grows, so a worker released now stays releasable; one pass in worker
  // order finds every reply that may go.
  std::vector<int64_t> out;
  const int64_t lo = minClock();
  for (int64_t w = 0; w < workers(); ++w) {
    if (held_[w] && mayGo(w)) {
      held_[w] = false;
      widestGap_ = std::max(widestGap_, clock_[w] - lo);
      out.push_back(w);
    }
  }
  return out;
}

std::vector<int64_t> StalenessClock::push(int64_t worker) {
  checkWorker(worker, "push");
  if (closed_[worker]) {
    throw std::logic_error("StalenessClock: worker " + std::to_string(worker) +
                           " pushed after it closed");
  }
  if (held_[worker]) {
    throw std::logic_error("StalenessClock: worker " + std::to_string(worker) +
                           " pushed again before its reply to push " +
                           std::to_string(clock_[worker]) + " went");
  }
  ++clock_[worker];
  held_[worker] = true;
  return releaseHeld();
}

std::vector<int64_t> StalenessClock::close(int64_t worker) {
  checkWorker(worker, "close");
  if (closed_[worker]) {
    throw std::logic_error("StalenessClock: worker " + std::to_string(worker) +
                           " closed twice");
  }
  if (held_[worker]) {
    throw std::logic_error("StalenessClock: worker " + std::to_string(worker) +
                           " closed while waiting for its reply to push " +
                           std::to_string(clock_[worker]));
  }
  closed_[worker] = true;
  --open_;
  return releaseHeld();
}

std::string StalenessClock::describe() const {
  std::ostringstream os;
  os << "bound " << (maxStaleness_ < 0 ? std::string("none") : std::to_string(maxStaleness_))
     << ", slowest open clock " << minClock() << ":";
  for (int64_t w = 0; w < workers(); ++w) {
    os << " w" << w << "=" << clock_[w] << (closed_[w] ? "(closed)" : held_[w] ? "(held)" : "");
  }
  return os.str();
}

} // namespace tdx::parallel
