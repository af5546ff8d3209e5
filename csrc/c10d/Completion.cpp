#include "c10d/Completion.hpp"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace tdx {
namespace {

class CompletionPool {
 public:
  void post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
    // A new thread when none is idle: the busy ones may all be blocked in callbacks
    // that wait for the very completion being posted. The cap only bounds a runaway
    // nesting depth.
    if (idle_ == 0 && threads_ < kMaxThreads) {
      ++threads_;
      std::thread([this] { loop(); }).detach();
    } else {
      cv_.notify_one();
    }
  }

 private:
  static constexpr int kMaxThreads = 64;

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [&] { return !queue_.empty(); });
      --idle_;
      auto fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
  int threads_ = 0;
};

} // namespace

void postCompletion(std::function<void()> fn) {
  // Leaked on purpose: its detached threads may still be parked at process exit, and a
  // static destructor must not pull the queue from under them.
  static auto* pool = new CompletionPool();
  pool->post(std::move(fn));
}

} // namespace tdx
