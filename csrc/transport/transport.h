// Bytes between peers. Knows nothing of collectives or torch: a Transport moves a
// contiguous buffer to an endpoint under a 64-bit tag and reports completion.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdx {
namespace transport {

enum class MemType { Host, Cuda };

using Clock = std::chrono::steady_clock;

// A failure that involves one peer (lost connection, truncated message, cancelled
// receive). `peer` is the transport endpoint id, translated to a rank by the caller.
class PeerError : public std::runtime_error {
 public:
  PeerError(int endpoint, const std::string& what)
      : std::runtime_error(what), endpoint_(endpoint) {}
  int endpoint() const {
    return endpoint_;
  }

 private:
  int endpoint_;
};

// Bytes of memory held, process-wide, for transfers the transport has not let go of
// (see Request::holdUntilReleased): what abandoned transfers still pin.
inline std::atomic<int64_t>& heldBytes() {
  static std::atomic<int64_t> bytes{0};
  return bytes;
}

// `owner` counted in heldBytes() for as long as the returned handle (or a copy) lives.
inline std::shared_ptr<const void> countedHold(std::shared_ptr<const void> owner, size_t bytes) {
  class Hold {
   public:
    Hold(std::shared_ptr<const void> owner, size_t bytes)
        : owner_(std::move(owner)), bytes_(static_cast<int64_t>(bytes)) {
      heldBytes().fetch_add(bytes_, std::memory_order_relaxed);
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() {
      heldBytes().fetch_sub(bytes_, std::memory_order_relaxed);
    }

   private:
    std::shared_ptr<const void> owner_;
    int64_t bytes_;
  };
  return std::make_shared<const Hold>(std::move(owner), bytes);
}

// One in-flight send or receive. Completed exactly once, by the transport.
struct Request {
  enum class State : int { Pending = 0, Ok = 1, Failed = 2 };

  std::atomic<State> state{State::Pending};
  std::string error;        // set before state becomes Failed
  size_t postedBytes = 0;   // the buffer length given at post time
  size_t receivedBytes = 0; // receives: the length that arrived
  uint64_t senderTag = 0;   // receives: the full tag that matched (any-source senders)
  int endpoint = -1;        // -1 for a receive from any source
  bool isSend = false;
  bool truncated = false;   // receives: the message was longer than the buffer (Failed)
  // Failed by the transport while UCX still holds the buffer (a receive a lost peer left
  // part-filled, a request abandoned at shutdown): done, but its buffer must never be
  // reused.
  std::atomic<bool> orphaned{false};
  // Posted for the life of a group rather than for an op (a peer's goodbye): a peer
  // that goes away with only these pending had nothing waiting on it.
  std::atomic<bool> background{false};

  // Called once from the thread that observed completion, outside transport locks.
  std::function<void(Request&)> onComplete;

  // Runs onComplete if nobody has yet: more than one thread may see a request end (a
  // completion racing a lost peer's clean-up), and the callback must run once.
  void runOnComplete() {
    std::function<void(Request&)> cb;
    {
      std::lock_guard<std::mutex> lock(mu);
      cb.swap(onComplete);  // leaves onComplete empty, unlike a move
    }
    if (cb) cb(*this);
  }

  // Keeps `owner` (a countedHold of memory this request's transfer reads or writes)
  // until the request itself goes. A transport holds each request until UCX lets go of
  // it, so this is how a request ended on this side only (orphaned: abandoned, or failed
  // for a lost peer) keeps its buffer from the allocator while UCX may still read or
  // write it. A transport lets go earlier where it knows nothing can any more (a send to
  // a dead watched peer; see `released`), and later where a live peer still might.
  void holdUntilReleased(std::shared_ptr<const void> owner) {
    std::unique_lock<std::mutex> lock(mu);
    if (released) {
      lock.unlock();  // let go of already (see UcxTransport::releaseSends): goes now
      owner.reset();
      return;
    }
    held.push_back(std::move(owner));
  }
  // What the request holds, handed to the caller (who lets it go outside any lock); a
  // hold attached from here on goes at once.
  std::vector<std::shared_ptr<const void>> releaseHeld() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    return std::move(held);
  }

  bool done() const {
    return state.load(std::memory_order_acquire) != State::Pending;
  }
  bool ok() const {
    return state.load(std::memory_order_acquire) == State::Ok;
  }

  // Internal to transports.
  std::atomic<void*> handle{nullptr};
  void* owner = nullptr;
  bool retired = false;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<const void>> held;  // see holdUntilReleased()
  bool released = false;  // nothing reads or writes the buffer any more: hold nothing
};
using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;

  // Opaque bytes a peer passes to connect() to reach this process.
  virtual std::string address() const = 0;

  // Returns an endpoint id for the peer at `address`; the same address gives the same id.
  virtual int connect(const std::string& address) = 0;

  // `acknowledged`: the send completes only once the receiver has matched it, not once
  // its bytes are out (UCX's synchronous send), so a message no receive will take keeps
  // its send waiting instead of sitting unreceived at the peer.
  virtual RequestPtr isend(int endpoint, uint64_t tag, const void* data, size_t bytes,
                           MemType mem, std::function<void(Request&)> onComplete = nullptr,
                           bool acknowledged = false) = 0;

  // `endpoint` is used only to cancel the receive if that peer fails (-1: any source).
  // A message matches when (messageTag & tagMask) == (tag & tagMask).
  virtual RequestPtr irecv(int endpoint, uint64_t tag, uint64_t tagMask, void* data,
                           size_t bytes, MemType mem,
                           std::function<void(Request&)> onComplete = nullptr) = 0;

  // Whether a message matching (tag, tagMask) has arrived and waits unreceived; its tag
  // goes to `found`. The message stays where it is, for the receive that wants it.
  virtual bool probe(uint64_t tag, uint64_t tagMask, uint64_t& found) = 0;

  // Blocks until the request completes or the deadline passes (returns false then; the
  // request is still pending and must be cancelled).
  virtual bool wait(Request& request, Clock::time_point deadline) = 0;

  // One round of the work the progress thread does, on the calling thread, for a waiter
  // that polls before it sleeps. Completion callbacks may run inside it.
  virtual void progress() = 0;

  // Asks the transport to end a pending request with `reason`; completion (as Failed)
  // is still reported through the request.
  virtual void cancel(Request& request, const std::string& reason) = 0;
  // Ends a pending request at once with `reason`, as a lost sender's clean-up does: UCX
  // may still hold its buffer, so the request is marked orphaned (the buffer must never
  // be reused or freed). For what cancel() cannot end: a receive UCX has already matched
  // to a message whose sender is gone, and which no lost endpoint names (any source); a
  // send of a group shut down before its peer received it.
  virtual void abandon(Request& request, const std::string& reason) = 0;

  // True once the endpoint's peer has been reported lost.
  virtual bool endpointFailed(int endpoint) const = 0;
  // Reports now, instead of at the progress thread's next look, the peers on this host
  // whose process has exited, so that endpointFailed() covers them. For a caller that
  // learnt of an exit another way and is about to message the other peers: the first
  // message to a dead peer over shared memory maps a segment that died with it, and UCX
  // logs the failure.
  virtual void noteExitedPeers() = 0;
  // How many endpoints have been reported lost so far: one atomic load, so per-op
  // checks look at individual endpoints only after it changes.
  virtual uint64_t failedEndpoints() const = 0;
};

} // namespace transport
} // namespace tdx
