#include "c10d/FutureDeadlines.hpp"

#include "c10d/WorkTDX.hpp"

#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace tdx {
namespace futureDeadlines {

namespace {

using Clock = std::chrono::steady_clock;

class Deadlines {
 public:
  static Deadlines& get() {
    // Never destroyed: works may complete (and disarm) during static destruction.
    static auto* deadlines = new Deadlines;
    return *deadlines;
  }

  void arm(Clock::time_point at, const c10::intrusive_ptr<WorkTDX>& work) {
    std::lock_guard<std::mutex> lock(mu_);
    if (armed_.count(work.get()) != 0) return;  // the first get_future() started the clock
    armed_[work.get()] = at;
    due_.emplace(std::make_pair(at, work.get()), c10::weak_intrusive_ptr<WorkTDX>(work));
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
    cv_.notify_one();
  }

  void disarm(const WorkTDX* work) {
    std::optional<c10::weak_intrusive_ptr<WorkTDX>> held;  // dropped after the lock: see run()
    std::lock_guard<std::mutex> lock(mu_);
    auto it = armed_.find(work);
    if (it == armed_.end()) return;
    auto due = due_.find(std::make_pair(it->second, work));
    held.emplace(std::move(due->second));
    due_.erase(due);
    armed_.erase(it);
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const Clock::time_point next = due_.begin()->first.first;
      if (Clock::now() < next) {
        cv_.wait_until(lock, next);
        continue;
      }
      std::vector<c10::weak_intrusive_ptr<WorkTDX>> expired;
      while (!due_.empty() && due_.begin()->first.first <= Clock::now()) {
        armed_.erase(due_.begin()->first.second);
        expired.push_back(std::move(due_.begin()->second));
        due_.erase(due_.begin());
      }
      lock.unlock();
      // Outside the lock: expiring cancels transfers, whose completions disarm, and the
      // last reference to a work (weak ones included) destroys it.
      for (auto& weak : expired) {
        if (auto work = weak.lock()) work->expire();
      }
      expired.clear();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<Clock::time_point, const WorkTDX*>, c10::weak_intrusive_ptr<WorkTDX>> due_;
  std::map<const WorkTDX*, Clock::time_point> armed_;
  bool started_ = false;
};

} // namespace

void arm(Clock::time_point at, const c10::intrusive_ptr<WorkTDX>& work) {
  Deadlines::get().arm(at, work);
}

void disarm(const WorkTDX* work) {
  Deadlines::get().disarm(work);
}

} // namespace futureDeadlines
} // namespace tdx
