// Helper threads for memory passes (see pass_pool.h).
//
// One job at a time per process: the caller publishes it by bumping a generation
// counter, every helper (working on it or not) counts itself off when done with it, and
// only then may the next job overwrite the description. Helpers spin a little after a
// job, because a collective's passes come back to back (three per chunk of a window's
// half), and then sleep on a condition variable.
#include "algorithms/pass_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>

namespace tdx {
namespace algorithms {
namespace {

constexpr int kMaxHelpers = kMaxPassThreads - 1;  // and the caller
constexpr size_t kMinPartBytes = 64 << 10;
constexpr auto kSpin = std::chrono::microseconds(200);

class PassPool {
 public:
  static PassPool*& instance() {
    // Never destroyed: helpers may still be asleep in it when the process exits.
    static PassPool* pool = [] {
      // A forked child has none of the parent's helpers: it starts a pool of its own.
      pthread_atfork(nullptr, nullptr, [] { instance() = new PassPool(); });
      return new PassPool();
    }();
    return pool;
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
    ways_ = ways;
    pending_.store(helpers_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    try {
      runPart(0);
    } catch (...) {  // fn must not throw; if it did, the helpers still use the job
      waitForHelpers();
      throw;
    }
    waitForHelpers();
    return true;
  }

 private:
  void waitForHelpers() {
    while (pending_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  }

  // Starts helpers up to `want` (at most kMaxHelpers); returns how many exist.
  int ensureHelpers(int want) {
    want = std::min(want, kMaxHelpers);
    while (helpers_ < want) {
      const int index = helpers_ + 1;  // parts 1, 2, ...; part 0 is the caller's
      const uint64_t seen = generation_.load(std::memory_order_acquire);
      try {
        std::thread([this, index, seen] { helperLoop(index, seen); }).detach();
      } catch (const std::system_error&) {
        break;  // counted only once running: every counted helper counts itself off
      }
      helpers_ = index;
    }
    return helpers_;
  }

  void helperLoop(int index, uint64_t seen) {
    for (;;) {
      const auto spinUntil = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < spinUntil) {
        std::this_thread::yield();
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index < ways_) runPart(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void runPart(int index) {
    // Part boundaries on `grain`: the first parts take one grain more when the grains
    // do not divide evenly.
    const size_t grains = (bytes_ + grain_ - 1) / grain_;
    const size_t base = grains / ways_, extra = grains % ways_;
    const size_t first = index * base + std::min<size_t>(index, extra);
    const size_t count = base + (static_cast<size_t>(index) < extra ? 1 : 0);
    const size_t begin = std::min(bytes_, first * grain_);
    const size_t end = std::min(bytes_, (first + count) * grain_);
    if (begin < end) call_(fn_, begin, end);
  }

  std::mutex runMu_;  // one job at a time
  std::mutex mu_;     // with cv_: helpers asleep between jobs
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};  // helpers not yet done with the current job
  int helpers_ = 0;              // under runMu_
  // The current job, written under runMu_ before the generation moves on, read by the
  // helpers after they see it move.
  void (*call_)(const void*, size_t, size_t) = nullptr;
  const void* fn_ = nullptr;
  size_t bytes_ = 0, grain_ = 1;
  int ways_ = 1;
};

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
