// When a parameter server may answer a worker's push (stale synchronous parallel).
//
// A worker pushes its gradient and waits for the server's reply, which carries the
// parameters it computes its next gradient on. Its clock is the number of pushes the
// server has taken from it. With a bound s, the reply to a worker at clock c goes out only
// once every open worker has reached clock c - s: no worker is answered while more than s
// pushes ahead of the slowest one that is still training. What waits is the answer, not
// the push: the others' pushes are applied while a worker computes, so its gradient may
// miss up to 2s + 1 pushes of each other worker (s = 1: A is answered at clock 2 with B
// at 1; B then pushes 2, 3 and 4, all applied, and only 4's answer waits). s = 0 lets
// the workers advance in rounds; no bound (a negative s) answers every push at once
// (fully asynchronous).
//
// A closed worker leaves the minimum: the others no longer wait for it.
//
// No torch, no communication: the server's bookkeeping, tested exhaustively in one
// process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tdx::parallel {

class StalenessClock {
 public:
  // Throws std::invalid_argument for fewer than one worker.
  StalenessClock(int64_t workers, int64_t maxStaleness);

  // Worker w's push arrived. Returns the workers whose replies may go now, w among them
  // or not, in worker order. Throws std::logic_error for a worker that is closed or still
  // waiting for its previous reply (the server would have answered a push it never sent).
  std::vector<int64_t> push(int64_t worker);
  // Worker w stopped training. Returns the held workers this frees, in worker order.
  std::vector<int64_t> close(int64_t worker);

  int64_t workers() const { return static_cast<int64_t>(clock_.size()); }
  int64_t maxStaleness() const { return maxStaleness_; }
  int64_t clock(int64_t worker) const;
  bool held(int64_t worker) const;
  bool closed(int64_t worker) const;
  bool allClosed() const { return open_ == 0; }
  // The smallest clock of an open worker; the largest clock of all when every worker is
  // closed.
  int64_t minClock() const;
  // Largest clock gap seen between a worker at the moment its reply went and the slowest
  // open worker then: at most maxStaleness when bounded.
  int64_t widestGap() const { return widestGap_; }
  std::string describe() const;

 private:
  void checkWorker(int64_t worker, const char* what) const;
  bool mayGo(int64_t worker) const;
  std::vector<int64_t> releaseHeld();

  std::vector<int64_t> clock_;
  std::vector<bool> held_;
  std::vector<bool> closed_;
  int64_t maxStaleness_;
  int64_t open_;
  int64_t widestGap_ = 0;
};

} // namespace tdx::parallel
