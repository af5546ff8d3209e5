// Helper threads for memory passes (see pass_pool.h).
//
// One job at a time per process. The caller publishes a job as one atomic word: its
// generation, how many parts it has, and the next part not yet taken. Whoever takes a
// part (the caller first, then any helper that is awake) claims it by moving that index
// on with a compare-and-swap of the whole word, runs it, and counts it done; the caller
// takes parts too until none are left, then waits only for the parts others took. So a
// pass never waits for a helper to be woken: on a host with fewer free cores than
// helpers the caller runs the parts nobody has claimed (a helper that claimed one and
// then lost its core still holds the pass up), and helpers a pass does not need wake,
// find nothing left and sleep again. The next job may overwrite the
// description only when every part is done, which is what keeps a helper that claimed a
// part reading the right one. Helpers spin a little after a job, because a collective's
// passes come back to back (three per chunk of a window's half), and then sleep on a
// futex, which one system call wakes as many of as the job has parts for.
#include "algorithms/pass_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace tdx {
namespace algorithms {
namespace {

constexpr int kMaxHelpers = kMaxPassThreads - 1;  // and the caller
constexpr size_t kMinPartBytes = 64 << 10;
constexpr auto kSpin = std::chrono::microseconds(200);

// The job word: generation above, then the part count and the next part to take, a
// byte each.
constexpr int kByte = 8;
static_assert(kMaxPassThreads < (1 << kByte), "part counts must fit a byte of the job word");
constexpr uint64_t jobWord(uint64_t generation, int parts, int next) {
  return generation << (2 * kByte) | static_cast<uint64_t>(parts) << kByte |
         static_cast<uint64_t>(next);
}
constexpr uint64_t generationOf(uint64_t word) { return word >> (2 * kByte); }
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "the futex is the atomic's own 32 bits");
constexpr int partsOf(uint64_t word) { return static_cast<int>((word >> kByte) & 0xff); }
constexpr int nextOf(uint64_t word) { return static_cast<int>(word & 0xff); }

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
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = generationOf(job_.load(std::memory_order_relaxed)) + 1;
    // Sequentially consistent, as the helpers' count of sleepers and their look at the
    // job are: either this thread sees a helper counted as asleep and wakes it, or that
    // helper sees the job before it sleeps. The futex word moves with the generation
    // (its low 32 bits), so a helper about to sleep on the old value is refused by the
    // kernel and looks again.
    job_.store(jobWord(generation, ways, 0));
    wake_.store(static_cast<uint32_t>(generation));
    if (sleepers_.load() > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, ways - 1,
              nullptr, nullptr, 0);
    }
    int mine = 0;
    try {
      for (int part; (part = claim(generation)) >= 0; ++mine) runPart(part, ways);
    } catch (...) {  // fn must not throw; if it did, parts others took still use the job
      done_.fetch_add(mine + 1, std::memory_order_relaxed);
      closeJob(generation, ways);
      waitForParts(ways);
      throw;
    }
    done_.fetch_add(mine, std::memory_order_relaxed);
    waitForParts(ways);
    return true;
  }

 private:
  // Takes the next part of job `generation`: its index, or -1 when none is left (or the
  // job is another).
  int claim(uint64_t generation) {
    uint64_t word = job_.load(std::memory_order_acquire);
    while (generationOf(word) == generation && nextOf(word) < partsOf(word)) {
      const uint64_t taken = jobWord(generation, partsOf(word), nextOf(word) + 1);
      if (job_.compare_exchange_weak(word, taken, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
        return nextOf(word);
      }
    }
    return -1;
  }

  // After a throw: no part not yet taken may start; they count as done.
  void closeJob(uint64_t generation, int ways) {
    uint64_t word = job_.load(std::memory_order_acquire);
    while (generationOf(word) == generation && nextOf(word) < ways) {
      if (job_.compare_exchange_weak(word, jobWord(generation, ways, ways),
                                     std::memory_order_acq_rel, std::memory_order_acquire)) {
        done_.fetch_add(ways - nextOf(word), std::memory_order_relaxed);
        return;
      }
    }
  }

  void waitForParts(int ways) {
    while (done_.load(std::memory_order_acquire) < ways) std::this_thread::yield();
  }

  // Starts helpers up to `want` (at most kMaxHelpers); returns how many exist.
  int ensureHelpers(int want) {
    want = std::min(want, kMaxHelpers);
    while (helpers_ < want) {
      const uint64_t seen = generationOf(job_.load(std::memory_order_acquire));
      try {
        std::thread([this, seen] { helperLoop(seen); }).detach();
      } catch (...) {  // std::system_error, or std::bad_alloc for the thread's state
        break;
      }
      ++helpers_;
    }
    return helpers_;
  }

  void helperLoop(uint64_t seen) {
    auto moved = [&] {
      return generationOf(job_.load(std::memory_order_acquire)) != seen;
    };
    for (;;) {
      const auto spinUntil = std::chrono::steady_clock::now() + kSpin;
      while (!moved() && std::chrono::steady_clock::now() < spinUntil) {
        std::this_thread::yield();
      }
      while (!moved()) {
        // Counted as asleep before the last look at the job (both sequentially
        // consistent; see run()).
        sleepers_.fetch_add(1);
        const uint32_t value = static_cast<uint32_t>(seen);
        if (generationOf(job_.load()) == seen) {
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAIT_PRIVATE, value,
                  nullptr, nullptr, 0);
        }
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      const uint64_t word = job_.load(std::memory_order_acquire);
      seen = generationOf(word);
      const int ways = partsOf(word);
      int mine = 0;
      for (int part; (part = claim(seen)) >= 0; ++mine) runPart(part, ways);
      // Release: the parts' writes, and this thread's reads of the description, come
      // before the caller may publish the next job.
      if (mine > 0) done_.fetch_add(mine, std::memory_order_release);
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
  std::atomic<uint64_t> job_{0};        // jobWord(generation, parts, next) of the latest job
  std::atomic<int> done_{0};            // parts of the current job done
  std::atomic<uint32_t> wake_{0};       // the futex helpers sleep on: the generation's low bits
  std::atomic<int> sleepers_{0};        // helpers on the futex, or about to be
  int helpers_ = 0;                     // under runMu_
  // The current job, written under runMu_ before its word is stored, read only by the
  // threads that claimed a part of it (the caller waits for those before the next job).
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
