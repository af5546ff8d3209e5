// Helper threads for memory passes (see pass_pool.h).
//
// One job at a time per process. The caller publishes a job as one atomic word, its
// generation and how many ways it splits, and wakes only the helpers that take a part
// (down a tree: each wakes at most two); each of those counts itself off when done, and only then may the next job overwrite
// the description. A helper that takes no part reads nothing but that word, so the
// caller never waits for it: on a host whose ranks hold more helpers than a pass of a
// few hundred KiB splits over, a pass ends when its own parts do, not when every
// sleeping helper has been scheduled. Helpers spin a little after a job, because a
// collective's passes come back to back (three per chunk of a window's half), and then
// sleep on a condition variable of their own.
#include "algorithms/pass_pool.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace tdx {
namespace algorithms {
namespace {

constexpr int kMaxHelpers = kMaxPassThreads - 1;  // and the caller
constexpr size_t kMinPartBytes = 64 << 10;
constexpr auto kSpin = std::chrono::microseconds(200);

// The job word: generation above, ways in the low byte.
constexpr int kWaysBits = 8;
static_assert(kMaxPassThreads < (1 << kWaysBits), "ways must fit the job word's low byte");
constexpr uint64_t jobWord(uint64_t generation, int ways) {
  return generation << kWaysBits | static_cast<uint64_t>(ways);
}
constexpr uint64_t generationOf(uint64_t word) { return word >> kWaysBits; }
constexpr int waysOf(uint64_t word) {
  return static_cast<int>(word & ((uint64_t{1} << kWaysBits) - 1));
}

class PassPool {
 public:
  // The process's pool. Made when the library loads, not on first use: a function-local
  // static would be half made in a child forked during its setup (by another thread),
  // and the child would wait on its guard forever, in the fork handler or its first
  // pass. Never destroyed: helpers may still be asleep in it when the process exits.
  static PassPool* instance() { return current_.load(std::memory_order_acquire); }

  // At load: the first pool, and a fork handler that gives a child a pool of its own
  // (it has none of the parent's helpers; the child runs one thread when it is called).
  static bool start() {
    current_.store(new PassPool(), std::memory_order_release);
    pthread_atfork(nullptr, nullptr,
                   [] { current_.store(new PassPool(), std::memory_order_release); });
    return true;
  }

  // False when another thread holds the helpers.
  bool run(size_t bytes, size_t grain, int ways, void (*call)(const void*, size_t, size_t),
           const void* fn) {
    std::unique_lock<std::mutex> busy(runMu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    // The helpers that exist: a thread that could not be started (a process or cgroup
    // limit) leaves fewer, and the pass is split fewer ways.
    ways = std::min(ways, ensureHelpers(ways - 1) + 1);
    if (ways <= 1) return false;
    call_ = call;
    fn_ = fn;
    bytes_ = bytes;
    grain_ = grain;
    pending_.store(ways - 1, std::memory_order_relaxed);
    const uint64_t generation = generationOf(job_.load(std::memory_order_relaxed)) + 1;
    job_.store(jobWord(generation, ways), std::memory_order_release);
    // Helpers 1 .. ways-1 take parts, woken down a binary tree (see wakeChildren).
    wakeChildren(0, ways);
    try {
      runPart(0, ways);
    } catch (...) {  // fn must not throw; if it did, the helpers still use the job
      waitForHelpers();
      throw;
    }
    waitForHelpers();
    return true;
  }

 private:
  struct Sleeper {
    std::mutex mu;
    std::condition_variable cv;
  };

  // Wakes the helpers below `index` in the job's tree: 2·index+1 and 2·index+2, where
  // they take part. Every part-taker wakes its own, so no thread makes more than two
  // wake-up calls: one thread waking them all would, on a host with fewer free cores
  // than helpers, lose its core to each helper it wakes before waking the next.
  // Taking a helper's lock after the job's store means a helper about to sleep either
  // sees the job in its wait predicate or is already waiting when notified.
  void wakeChildren(int index, int ways) {
    for (int child = 2 * index + 1; child <= 2 * index + 2 && child < ways; ++child) {
      Sleeper& s = sleepers_[child];
      { std::lock_guard<std::mutex> lock(s.mu); }
      s.cv.notify_one();
    }
  }

  void waitForHelpers() {
    while (pending_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  }

  // Starts helpers up to `want` (at most kMaxHelpers); returns how many exist.
  int ensureHelpers(int want) {
    want = std::min(want, kMaxHelpers);
    while (helpers_ < want) {
      const int index = helpers_ + 1;  // parts 1, 2, ...; part 0 is the caller's
      const uint64_t seen = generationOf(job_.load(std::memory_order_acquire));
      try {
        std::thread([this, index, seen] { helperLoop(index, seen); }).detach();
      } catch (...) {  // std::system_error, or std::bad_alloc for the thread's state
        break;  // counted only once running: a job never names a helper that is not
      }
      helpers_ = index;
    }
    return helpers_;
  }

  void helperLoop(int index, uint64_t seen) {
    Sleeper& s = sleepers_[index];
    auto moved = [&] { return generationOf(job_.load(std::memory_order_acquire)) != seen; };
    for (;;) {
      const auto spinUntil = std::chrono::steady_clock::now() + kSpin;
      while (!moved() && std::chrono::steady_clock::now() < spinUntil) {
        std::this_thread::yield();
      }
      if (!moved()) {
        std::unique_lock<std::mutex> lock(s.mu);
        s.cv.wait(lock, moved);
      }
      // One load decides: a helper that missed jobs (it took no part in them, or the
      // caller would still be waiting for it) joins the latest one if that one names it.
      const uint64_t word = job_.load(std::memory_order_acquire);
      seen = generationOf(word);
      const int ways = waysOf(word);
      if (index < ways) {
        wakeChildren(index, ways);
        runPart(index, ways);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  void runPart(int index, int ways) {
    // Part boundaries on `grain`: the first parts take one grain more when the grains
    // do not divide evenly.
    const size_t grains = (bytes_ + grain_ - 1) / grain_;
    const size_t base = grains / ways, extra = grains % ways;
    const size_t first = index * base + std::min<size_t>(index, extra);
    const size_t count = base + (static_cast<size_t>(index) < extra ? 1 : 0);
    const size_t begin = std::min(bytes_, first * grain_);
    const size_t end = std::min(bytes_, (first + count) * grain_);
    if (begin < end) call_(fn_, begin, end);
  }

  static std::atomic<PassPool*> current_;
  std::mutex runMu_;  // one job at a time
  std::array<Sleeper, kMaxHelpers + 1> sleepers_;  // by helper index; 0 is unused
  std::atomic<uint64_t> job_{0};    // jobWord(generation, ways) of the latest job
  std::atomic<int> pending_{0};     // helpers not yet done with their part of it
  int helpers_ = 0;                 // under runMu_
  // The current job, written under runMu_ before its word is stored, read only by the
  // helpers it names, after they load that word.
  void (*call_)(const void*, size_t, size_t) = nullptr;
  const void* fn_ = nullptr;
  size_t bytes_ = 0, grain_ = 1;
};

std::atomic<PassPool*> PassPool::current_{nullptr};
[[maybe_unused]] const bool started = PassPool::start();

} // namespace

int passWays(size_t bytes, int ways) {
  const size_t worth = std::max<size_t>(1, bytes / kMinPartBytes);
  return static_cast<int>(std::min<size_t>(
      {static_cast<size_t>(std::max(ways, 1)), worth, static_cast<size_t>(kMaxHelpers + 1)}));
}

namespace detail {

bool splitPass(size_t bytes, size_t grain, int ways,
               void (*call)(const void*, size_t, size_t), const void* fn) {
  // Grains are a reduction block (16 KiB) at most, well under a part: cutting on them
  // leaves the parts near equal.
  ways = passWays(bytes, ways);
  return ways > 1 &&
         PassPool::instance()->run(bytes, std::max<size_t>(1, grain), ways, call, fn);
}

} // namespace detail

} // namespace algorithms
} // namespace tdx
