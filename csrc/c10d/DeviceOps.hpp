// Device-resident collectives: ops on CUDA tensors that leave their work on the group's
// own stream instead of staging through host memory.
//
// Stream discipline (PyTorch's contract for collectives):
//  - the caller's current stream records `ready` at the call; the backend stream waits on
//    it, so the op sees everything the caller queued before it, without a host sync;
//  - the op's last step records `done` on the backend stream; Work::wait() makes the
//    caller's current stream wait on `done`, again without a host sync;
//  - tensors are recorded on the backend stream (the caching allocator's record_stream),
//    so freeing them right after an async op cannot hand their memory to a new tensor
//    while the op still reads or writes it.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "c10d/GroupChannel.hpp"
#include "c10d/Validation.hpp"

namespace tdx {

// Polls `done()` until it is true or `deadline` passes, then throws `timedOut`: a host
// wait on device work that may be stuck (a caller's kernel, a peer-memory op waiting for
// a lost rank) must not block the worker for good, which would never reach the watchdog
// that releases such work. Spins (yielding) for the first 200 µs, the usual length of a
// small op, then sleeps with backoff.
template <class Done>
void pollUntil(Done done, std::chrono::steady_clock::time_point deadline,
               const std::string& timedOut) {
  const auto spinUntil = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
  auto pause = std::chrono::microseconds(50);
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) throw std::runtime_error(timedOut);
    if (now < spinUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

struct DeviceContext {
  std::shared_ptr<c10::Event> ready;  // recorded on the caller's stream at the call
  std::shared_ptr<c10::Event> done;   // set by an op that left work on `stream`
  std::optional<c10::Stream> stream;  // the backend stream `done` was recorded on
  bool readySynced = false;
  // The latest the worker waits for `ready` (see pollUntil).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();

  // Host path: block the worker until the caller's stream has produced the inputs.
  void syncReady() {
    if (!ready || readySynced) return;
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      ready->synchronize();
    } else {
      pollUntil([&] { return ready->query(); }, deadline,
                "the caller's CUDA stream did not reach this op within the group timeout: "
                "work queued on it before the op (a kernel, or a peer-memory op waiting for "
                "a lost rank) is stuck");
    }
    readySynced = true;
  }
};

// One group's same-host peer-memory state: its IPC mappings, its signal flags and its
// stream. Every rank of a group makes the same choices in the same order, so a decision
// to use (or not use) this path is always collective.
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;

  // The group's state, or null when the build has no CUDA or TDX_CUDA_PEER=0.
  // `timeout` gives the group's current timeout (it can change after creation).
  static std::unique_ptr<PeerMemory> create(int rank, int size, std::string prefix,
                                            std::function<std::chrono::milliseconds()> timeout);

  // In-place allreduce of `t` through the peers' buffers. Returns false, having enqueued
  // nothing, when some rank of the group cannot take this path (another host, no peer
  // access, a non-contiguous tensor, ...); every rank then returns false and the caller
  // stages through host memory. `ch` carries the small host messages that agree on this.
  virtual bool allreduce(GroupChannel& ch, const at::Tensor& t, const Reduction& red,
                         DeviceContext& ctx) = 0;
  // The same contract for the tensor forms: `in` holds size() blocks of `out`'s size.
  virtual bool reduceScatter(GroupChannel& ch, const at::Tensor& out, const at::Tensor& in,
                             const Reduction& red, DeviceContext& ctx) = 0;
  // `out` holds size() blocks of `in`'s size; any dtype (bytes are copied).
  virtual bool allgather(GroupChannel& ch, const at::Tensor& out, const at::Tensor& in,
                         DeviceContext& ctx) = 0;
  // In place from `root`; any dtype.
  virtual bool broadcast(GroupChannel& ch, const at::Tensor& t, int root,
                         DeviceContext& ctx) = 0;

  // How many ops took this path so far (tests and logs).
  virtual uint64_t opsRun() const = 0;

  // Watchdog, called by the group's worker thread only. A stream waiting on a GPU flag
  // has no deadline of its own: if a peer dies mid-op, this rank's stream (and any
  // caller that syncs on it) would wait forever. hasPending() says whether device work
  // of earlier ops may still be waiting. releaseStalled() releases this rank's stream
  // when that work has waited past the group timeout: it writes the flags the stream
  // waits on, turns the path off, and returns a message naming the peers that never
  // signalled. The op's output is then undefined and the group must be treated as
  // broken; those of its tensors still alive stay allocated for the life of the
  // process, since a peer that is only slow may still write into them. It returns ""
  // when nothing stalled.
  virtual bool hasPending() = 0;
  virtual std::string releaseStalled() = 0;
};

} // namespace tdx
