// The Work returned by every tdx op: a completion flag (Work's own), a Future whose
// value is the op's output tensors (DDP comm hooks read it), and, for point-to-point
// ops and coalesced groups, a count of parts still in flight.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "c10d/RunningOp.hpp"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdx {

// The longest timeout honoured as given: a deadline is now + timeout in nanoseconds on a
// 64-bit clock, which overflows past about 292 years (timedelta.max, say) and lands in
// the past. Longer ones wait this long, which is to say for good.
constexpr std::chrono::milliseconds kLongestTimeout = std::chrono::hours(24 * 365 * 100);

class WorkTDX : public c10d::Work {
 public:
  WorkTDX(c10d::OpType opType, std::string description, uint64_t seq,
          std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
          const char* profilingTitle = nullptr,
          const std::optional<std::vector<at::Tensor>>& inputs = std::nullopt);
  ~WorkTDX() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  // Host part done (errors rethrown), then, for device-resident ops, the caller's current
  // stream waits on the op's end event: no host synchronisation with the GPU.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  int sourceRank() const override;
  uint64_t getSequencenumber() const override;
  std::chrono::milliseconds getTimeout() const;  // a Work virtual only in newer torch

  // Another part must finish before the work completes (p2p requests, coalesced ops).
  void addPart();
  // One part finished; the first error wins. The last part completes the work.
  void finishPart(std::exception_ptr error);

  // Called when wait() gives up, with the limit that ran out; should make the
  // outstanding parts finish (cancel).
  void setOnTimeout(std::function<void(std::chrono::milliseconds)> fn);
  // The latest a wait() without a timeout of its own waits for a collective: the op and
  // those queued ahead of it each end within the group timeout of their start, so this
  // is reached only if something below the op failed to end it.
  void setBackstop(std::chrono::steady_clock::time_point t) {
    std::lock_guard<std::mutex> lock(timeoutMu_);
    backstop_ = t;
  }
  // While wait() polls before sleeping, it calls `fn` to drive the op's transfers on the
  // waiting thread (a point-to-point op's transport) instead of only yielding: a small
  // op then completes right there, without waking the progress thread and then this one.
  void setProgress(std::function<void()> fn);
  // The group's record of its running op, named by a wait(timeout) that runs out on a
  // collective (which goes on).
  void setRunningOp(std::shared_ptr<const RunningOp> running) {
    running_ = std::move(running);
  }

  void setSourceRank(int rank) {
    sourceRank_.store(rank);
  }
  // The op left work on `stream` that ends with `done` (set before the last part
  // finishes). is_completed() then also asks the event, and the future's value is
  // ordered after it.
  void setDeviceDone(std::shared_ptr<c10::Event> done, c10::Stream stream);

  // A work that completes when `child` does (coalescing), its device work included.
  void attachChild(const c10::intrusive_ptr<WorkTDX>& child);
  void addChildDeviceDone(std::shared_ptr<c10::Event> done);

  const std::string& description() const {
    return description_;
  }

  // The deadline get_future() armed for an op that times itself (point-to-point) has
  // passed: ends the op as a wait() that timed out would (futureDeadlines).
  void expire();

 private:
  void complete(std::exception_ptr error);     // hands completeNow() to a completion thread
  // Returns the coalesced parent, which the caller tells (finishPart) once it holds no
  // lock of this work.
  c10::intrusive_ptr<WorkTDX> completeNow(std::exception_ptr error);

  std::string description_;
  uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  // Guarded by timeoutMu_, as are onTimeout_ and progress_.
  std::chrono::steady_clock::time_point backstop_ = std::chrono::steady_clock::time_point::max();
  bool backstopFromChildren_ = false;  // a coalesced block's: taken from its collectives
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> parts_{1};
  std::mutex errorMu_;
  std::exception_ptr firstError_;
  std::atomic<int> sourceRank_{-1};
  std::mutex timeoutMu_;
  // Whether anyone may have attached callbacks to the future (getFuture() was called, or
  // a coalesced parent listens). Until then completion runs on the finishing thread
  // itself, saving a thread hop; futureMu_ makes getFuture() wait for such a completion,
  // so a callback never runs on a group's worker.
  std::mutex futureMu_;
  bool futureShared_ = false;
  std::function<void(std::chrono::milliseconds)> onTimeout_;
  std::function<void()> progress_;  // guarded by timeoutMu_
  std::shared_ptr<const RunningOp> running_;  // set before the work is shared
  std::atomic<bool> deadlineArmed_{false};  // futureDeadlines holds this work
  // The coalesced work this one belongs to (attachChild), told directly when this one
  // completes: no listener on this work's future, so no completion thread in between.
  // Guarded by mutex_, with Work's completed_ and exception_.
  c10::intrusive_ptr<WorkTDX> parent_;
  std::shared_ptr<c10::Event> deviceDone_;
  std::optional<c10::Stream> deviceStream_;
  // A coalesced block's: its children's device work (guarded by mutex_), which wait(),
  // synchronize() and isCompleted() order after as after deviceDone_.
  std::vector<std::shared_ptr<c10::Event>> childDone_;
};

} // namespace tdx
