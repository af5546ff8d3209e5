#include "c10d/WorkTDX.hpp"

#include "c10d/Completion.hpp"
#include "c10d/FutureDeadlines.hpp"
#include "common/env.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <thread>

namespace tdx {

namespace {

std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.defined() && !t.is_cpu()) {
      bool seen = false;
      for (const auto& d : devices) seen = seen || d == t.device();
      if (!seen) devices.push_back(t.device());
    }
  }
  return devices;
}

} // namespace

WorkTDX::WorkTDX(c10d::OpType opType, std::string description, uint64_t seq,
                 std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                 const char* profilingTitle,
                 const std::optional<std::vector<at::Tensor>>& inputs)
    : Work(-1, opType, profilingTitle, inputs),
      description_(std::move(description)),
      seq_(seq),
      outputs_(std::move(outputs)),
      timeout_(timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), devicesOf(outputs_))) {}

WorkTDX::~WorkTDX() = default;

bool WorkTDX::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!completed_) return false;
  if (exception_) return true;
  if (deviceDone_ && !deviceDone_->query()) return false;
  for (const auto& done : childDone_) {
    if (!done->query()) return false;
  }
  return true;
}

void WorkTDX::addChildDeviceDone(std::shared_ptr<c10::Event> done) {
  std::lock_guard<std::mutex> lock(mutex_);
  childDone_.push_back(std::move(done));
}

void WorkTDX::setDeviceDone(std::shared_ptr<c10::Event> done, c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  deviceDone_ = std::move(done);
  deviceStream_ = stream;
}

void WorkTDX::synchronize() {
  std::vector<std::shared_ptr<c10::Event>> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (deviceDone_) events.push_back(deviceDone_);
    events.insert(events.end(), childDone_.begin(), childDone_.end());
  }
  for (const auto& done : events) {
    c10::impl::VirtualGuardImpl impl(done->device_type());
    done->block(impl.getStream(c10::Device(done->device_type(), done->device_index())));
  }
}

bool WorkTDX::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

bool WorkTDX::wait(std::chrono::milliseconds timeout) {
  std::function<void(std::chrono::milliseconds)> onTimeout;
  auto backstop = std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard<std::mutex> g(timeoutMu_);
    onTimeout = onTimeout_;
    backstop = backstop_;
  }
  // Without a timeout of its own, a wait ends when the op does. A collective's worker
  // gives each op the group's timeout from the moment the op starts, so one queued
  // behind slow ops is not failed by a clock that started at this call. Point-to-point
  // ops (those with an onTimeout) have no deadline but the wait's: the group's timeout.
  const bool unbounded = timeout == kNoTimeout && !onTimeout;
  const auto limit = std::min(timeout == kNoTimeout ? timeout_ : timeout, kLongestTimeout);
  std::unique_lock<std::mutex> lock(mutex_);
  if (!completed_) {
    // Small ops finish within microseconds: poll briefly (yielding the core) before
    // sleeping, as a wake-up costs tens of microseconds on a busy host.
    static const auto spin = std::chrono::microseconds(env::getInt("TDX_SPIN_US"));
    std::function<void()> progress;
    {
      std::lock_guard<std::mutex> g(timeoutMu_);
      progress = progress_;
    }
    const auto until = std::chrono::steady_clock::now() + spin;
    while (!completed_ && std::chrono::steady_clock::now() < until) {
      lock.unlock();
      // The op's completion may run inside progress(), on this thread: it takes mutex_.
      if (progress) {
        try {
          progress();
        } catch (...) {
          progress = nullptr;  // the transport's own thread still makes progress
        }
      }
      std::this_thread::yield();
      lock.lock();
    }
  }
  bool done = true;
  if (!unbounded) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    // A coalesced block of point-to-point ops and collectives: the point-to-point ops
    // get the group timeout from this call, the collectives as long as they need.
    if (timeout == kNoTimeout && backstop != std::chrono::steady_clock::time_point::max()) {
      deadline = std::max(deadline, backstop);
    }
    done = cv_.wait_until(lock, deadline, [&] { return completed_; });
  } else if (backstop == std::chrono::steady_clock::time_point::max()) {
    cv_.wait(lock, [&] { return completed_; });  // no backstop (a timeout of years)
  } else {
    done = cv_.wait_until(lock, backstop, [&] { return completed_; });
  }
  if (!done && unbounded) {
    C10_THROW_ERROR(DistBackendError,
                    description_ + " did not complete although it and every op queued ahead "
                                   "of it had " + std::to_string(limit.count()) +
                        " ms each: the backend failed to end it. Destroy the group and "
                        "report this with the log (TDX_DEBUG=INFO)");
  }
  if (!done) {
    if (onTimeout) {
      lock.unlock();
      onTimeout(limit);
      lock.lock();
      // Cancellation completes the parts quickly; if it does not, report the timeout.
      cv_.wait_for(lock, std::chrono::seconds(1), [&] { return completed_; });
    }
    if (!completed_) {
      // A collective goes on under its own limit (the group timeout from its start),
      // which names the ranks that did not reach it if it runs out.
      C10_THROW_ERROR(DistBackendError,
                      description_ + " did not complete within " +
                          std::to_string(limit.count()) +
                          " ms. A peer may not have posted the matching op; check that "
                          "every rank calls the same ops in the same order." +
                          (onTimeout ? std::string()
                                     : (running_ ? running_->describeFor(seq_) : "") +
                                           " The op goes on under the group timeout: wait() "
                                           "again for its result, or for an error that names "
                                           "the ranks that did not reach it."));
    }
  }
  if (exception_) std::rethrow_exception(exception_);
  lock.unlock();
  synchronize();
  return true;
}

std::vector<at::Tensor> WorkTDX::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkTDX::getFuture() {
  bool timesItself = false;
  auto backstop = std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard<std::mutex> g(timeoutMu_);
    timesItself = static_cast<bool>(onTimeout_);
    backstop = backstop_;
  }
  if (timesItself && !future_->completed() && !deadlineArmed_.exchange(true)) {
    // As wait() would: the group timeout from now, or the block's collectives' backstop
    // when that is later.
    auto at = std::chrono::steady_clock::now() + std::min(timeout_, kLongestTimeout);
    if (backstop != std::chrono::steady_clock::time_point::max()) at = std::max(at, backstop);
    futureDeadlines::arm(at, c10::intrusive_ptr<WorkTDX>::reclaim_copy(this));
    // Completed meanwhile: completeNow() may have looked for a deadline before this one
    // was armed (it completes the future first, then disarms).
    if (future_->completed()) futureDeadlines::disarm(this);
  }
  std::lock_guard<std::mutex> lock(futureMu_);
  futureShared_ = true;
  return future_;
}

void WorkTDX::expire() {
  std::function<void(std::chrono::milliseconds)> onTimeout;
  {
    std::lock_guard<std::mutex> g(timeoutMu_);
    onTimeout = onTimeout_;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
  }
  // Cancels the parts (or abandons a send UCX cannot cancel) and breaks the group: they
  // complete with the timeout as their error, and so does the future.
  if (onTimeout) onTimeout(timeout_);
}

int WorkTDX::sourceRank() const {
  int r = sourceRank_.load();
  TORCH_CHECK(r >= 0, "sourceRank() is only available for a completed recv from any source");
  return r;
}

uint64_t WorkTDX::getSequencenumber() const {
  return seq_;
}

std::chrono::milliseconds WorkTDX::getTimeout() const {
  return timeout_;
}

void WorkTDX::addPart() {
  parts_.fetch_add(1);
}

void WorkTDX::finishPart(std::exception_ptr error) {
  if (error) {
    std::lock_guard<std::mutex> lock(errorMu_);
    if (!firstError_) firstError_ = error;
  }
  if (parts_.fetch_sub(1) == 1) {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(errorMu_);
      e = firstError_;
    }
    complete(e);
  }
}

void WorkTDX::setOnTimeout(std::function<void(std::chrono::milliseconds)> fn) {
  std::lock_guard<std::mutex> lock(timeoutMu_);
  onTimeout_ = std::move(fn);
}

void WorkTDX::setProgress(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(timeoutMu_);
  progress_ = std::move(fn);
}

void WorkTDX::attachChild(const c10::intrusive_ptr<WorkTDX>& child) {
  addPart();
  {
    // A child that completed already (an eager send ends inside its post) counts now.
    std::unique_lock<std::mutex> lock(child->mutex_);
    if (child->completed_) {
      const std::exception_ptr e = child->exception_;
      std::shared_ptr<c10::Event> done = e ? nullptr : child->deviceDone_;
      lock.unlock();
      if (done) addChildDeviceDone(std::move(done));
      finishPart(e);
      return;  // nothing left to drive, time or cancel
    }
    child->parent_ = c10::intrusive_ptr<WorkTDX>::reclaim_copy(this);
  }
  std::function<void()> childProgress;
  bool childTimesItself = false;
  auto childBackstop = std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard<std::mutex> g(child->timeoutMu_);
    childProgress = child->progress_;
    childTimesItself = !child->onTimeout_;
    childBackstop = child->backstop_;
  }
  {
    std::lock_guard<std::mutex> lock(timeoutMu_);
    if (!progress_) progress_ = childProgress;
    if (childTimesItself) {
      // A collective is timed by the worker from its own start: the block waits for the
      // latest of its collectives' backstops, not for the group timeout from the call.
      backstop_ = backstopFromChildren_ ? std::max(backstop_, childBackstop) : childBackstop;
      backstopFromChildren_ = true;
      return;
    }
    auto previous = onTimeout_;
    onTimeout_ = [previous, child](std::chrono::milliseconds limit) {
      if (previous) previous(limit);
      std::function<void(std::chrono::milliseconds)> fn;
      {
        std::lock_guard<std::mutex> g(child->timeoutMu_);
        fn = child->onTimeout_;
      }
      if (fn) fn(limit);
    };
  }
}

void WorkTDX::complete(std::exception_ptr error) {
  // A future with listeners completes off the calling thread (a group's worker, the
  // transport's progress thread or a thread waiting in wait()): it runs user callbacks
  // inline, and they may wait for further collectives. Without listeners (futureMu_
  // keeps getFuture() out meanwhile) completing only wakes the waiters: done here, it
  // saves a thread hop per op.
  {
    std::unique_lock<std::mutex> lock(futureMu_);
    if (!futureShared_) {
      auto parent = completeNow(error);
      lock.unlock();
      // Outside futureMu_: the parent may complete here too, and this may be the last
      // reference to it.
      if (parent) parent->finishPart(error);
      return;
    }
  }
  auto self = c10::intrusive_ptr<WorkTDX>::reclaim_copy(this);
  postCompletion([self, error] {
    auto parent = self->completeNow(error);
    if (parent) parent->finishPart(error);
  });
}

c10::intrusive_ptr<WorkTDX> WorkTDX::completeNow(std::exception_ptr error) {
  if (error) {
    if (!future_->completed()) future_->setErrorIfNeeded(error);
  } else if (!future_->completed()) {
    // The future records its own events on the current streams of its devices: make
    // that the backend stream, so the value is ready only after the device work.
    c10::OptionalStreamGuard guard(deviceStream_);
    future_->markCompleted(c10::IValue(outputs_));
  }
  // After the future: getFuture() arms, then looks at the future again (see there).
  if (deadlineArmed_.load()) futureDeadlines::disarm(this);
  finish(error);
  // A parent attached after finish() saw completed_ and counted this one itself.
  c10::intrusive_ptr<WorkTDX> parent;
  std::shared_ptr<c10::Event> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    parent = std::move(parent_);
    done = deviceDone_;
  }
  // Device work the block's waiters must also order themselves after; handed over
  // before the caller finishes this part of the parent.
  if (parent && done && !error) parent->addChildDeviceDone(std::move(done));
  return parent;
}

} // namespace tdx
