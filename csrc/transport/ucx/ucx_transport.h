// UCX implementation of Transport: one context and worker per process, shared by every
// process group, with a progress thread that sleeps on the worker's event fd when idle.
//
// Threading: the worker runs in UCS_THREAD_MODE_MULTI so group threads post directly.
// UCX callbacks only record completion; everything that may call back into UCX or into
// user code (freeing requests, cancelling, onComplete hooks) is queued and run by
// whichever thread drains after ucp_worker_progress, never inside a UCX callback.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/process_watch.h"
#include "transport/transport.h"

namespace tdx {
namespace transport {

class UcxTransport final : public Transport {
 public:
  // What the group that starts the transport knows about where its ranks run. Only the
  // first group's hints count: later groups share the instance.
  struct Hints {
    // False lets TDX_UCX_TCP=auto leave UCX's TCP transport out, so the process listens
    // on no port: every rank that can ever be a peer runs on this host.
    bool tcpWanted = true;
    // Ranks of the group on this host (this one included).
    int localRanks = 1;
    // CPUs those ranks may run on together.
    int localCpus = 1;
  };

  // The process-wide instance, created on first use and destroyed when the last
  // holder lets go (so destroy + init in one process starts afresh).
  static std::shared_ptr<UcxTransport> acquire(const Hints& hints);

  // TDX_UCX_PEER_ERRORS: which endpoints get UCP_ERR_HANDLING_MODE_PEER.
  enum class PeerErrors { Never, Always, Unwatched };

  // The live instance, or null: for reports only, it starts nothing.
  static std::shared_ptr<UcxTransport> current();

  explicit UcxTransport(const Hints& hints);

  struct EndpointInfo {
    int id;
    int64_t pid;
    bool sameHost;    // the peer runs on this host (same boot and namespaces)
    bool watched;     // its exit is seen through a pidfd
    bool peerErrors;  // UCX's peer error handling is on (no shared memory to it)
    bool failed;
  };
  std::vector<EndpointInfo> endpointInfo() const;

  // The job's global ranks, for the log: this process's, and the peer's of `endpoint`
  // (set by the groups as they connect; until then lines name endpoints and pids).
  void setRank(int64_t rank) {
    rank_.store(rank, std::memory_order_relaxed);
  }
  void setPeerRank(int endpoint, int64_t rank);

  // Whether UCX's TCP transport is loaded (a listening port on every interface it uses).
  bool tcpLoaded() const {
    return tcpLoaded_;
  }
  // UCX_RNDV_THRESH as the transport set it ("" when UCX's own or the user's holds).
  const std::string& rendezvousThreshold() const {
    return rendezvousThreshold_;
  }
  ~UcxTransport() override;

  std::string address() const override;
  int connect(const std::string& address) override;
  RequestPtr isend(int endpoint, uint64_t tag, const void* data, size_t bytes, MemType mem,
                   std::function<void(Request&)> onComplete = nullptr,
                   bool acknowledged = false) override;
  RequestPtr irecv(int endpoint, uint64_t tag, uint64_t tagMask, void* data, size_t bytes,
                   MemType mem, std::function<void(Request&)> onComplete) override;
  bool probe(uint64_t tag, uint64_t tagMask, uint64_t& found) override;
  bool wait(Request& request, Clock::time_point deadline) override;
  void progress() override {
    // Without a multi-threaded worker only the progress thread may call into UCX's
    // progress (the construction warns about such a build).
    if (multiThreaded_) progressOnce();
  }
  void cancel(Request& request, const std::string& reason) override;
  void abandon(Request& request, const std::string& reason) override;
  bool endpointFailed(int endpoint) const override;
  void noteExitedPeers() override;
  uint64_t failedEndpoints() const override {
    return failedEndpoints_.load(std::memory_order_acquire);
  }

  // One progress pass plus the queued actions; returns the UCX progress count.
  unsigned progressOnce();

  // Called from the UCX callbacks (public only for the C trampolines).
  void onRequestDone(Request* request, void* ucxRequest, ucs_status_t status,
                     const ucp_tag_recv_info_t* info);
  void onEndpointError(int endpoint, ucs_status_t status);

 private:
  struct Endpoint {
    UcxTransport* owner = nullptr;
    int id = -1;
    ucp_ep_h ep = nullptr;
    std::atomic<bool> failed{false};
    std::string failure;
    // The peer's process is watched (same host, pidfd). Without UCX's peer error
    // handling as well, UCX may reach it over shared memory, and on the peer's exit the
    // endpoint is closed by force to end the sends still queued on it.
    bool watched = false;
    bool peerErrors = false;
    int64_t pid = 0;
    bool sameHost = false;
    int64_t rank = -1;  // the peer's global rank, once a group has said (setPeerRank)
  };

  // "[tdx transport]", with this process's global rank once a group has set it.
  std::string logPrefix() const;

  RequestPtr track(int endpoint, bool isSend, std::function<void(Request&)> onComplete);
  void finishImmediately(const RequestPtr& r, ucs_status_t status, size_t length,
                         uint64_t senderTag);
  void finishRequest(Request& r, bool ok, const std::string& error);
  // r.runOnComplete(), with whatever it throws logged instead of ending the thread.
  static void runCompletionGuarded(Request& r);
  void defer(std::function<void()> action);
  // Runs the deferred actions (one thread at a time; a nested call returns at once).
  void drain();
  void runDeferred();  // drain()'s loop, with drainMu_ held
  void progressLoop();
  // The constructor's worker, its address and the progress thread's epoll set.
  void startWorker();
  void wake();
  void closeEndpoints();
  bool chooseTcp(bool tcpWanted) const;
  // Marks the endpoint lost and fails what waits on it (any thread but inside UCX locks).
  void failEndpoint(int endpoint, const std::string& why);
  // Reports watched peers that exited; frees force-close requests that finished
  // (progress thread).
  void checkWatched();
  // Fails the receives of lost endpoints still pending after the grace (recvSweeps_).
  void sweepLostReceives();
  // Fails the endpoint's pending sends (or posted receives) with `why`, leaving their
  // UCX requests tracked until UCX lets go of them.
  void failPending(int endpoint, bool sends, const std::string& why);
  // Lets go of what sends to `endpoint` ended on this side earlier (abandoned) still
  // hold, once its completed force close leaves nothing that reads their buffers.
  void releaseSends(int endpoint);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;  // this process's ProcessId and UCX worker address, framed
  ProcessId self_;
  ProcessWatch watch_;
  // Shared by isend across its check of an endpoint and its post; exclusive while a lost
  // watched peer's endpoint handle is taken out to be closed by force.
  std::shared_mutex postMu_;
  std::mutex closingMu_;
  // ucp_ep_close_nbx requests of lost watched peers, with their endpoints: what sends to
  // one still hold is let go of once its close has completed (releaseSends).
  std::vector<std::pair<void*, int>> forceClosing_;
  // Lost endpoints whose receives still pending at the given time are failed then: UCX
  // cancels only receives it has not matched yet, and one that had begun taking in a
  // message in fragments waits forever for the rest from a dead peer. The grace lets
  // fragments already queued in this process's FIFOs and sockets land first.
  std::vector<std::pair<int, Clock::time_point>> recvSweeps_;  // under closingMu_
  static constexpr std::chrono::milliseconds kRecvSweepGrace{100};
  int eventFd_ = -1;
  int epollFd_ = -1;
  std::chrono::microseconds spin_;

  mutable std::mutex endpointsMu_;
  std::atomic<uint64_t> failedEndpoints_{0};
  std::atomic<int64_t> rank_{-1};  // see setRank()
  PeerErrors peerErrors_;
  bool tcpLoaded_ = true;
  bool multiThreaded_ = true;  // the worker got UCS_THREAD_MODE_MULTI
  std::string rendezvousThreshold_;
  std::mutex connectMu_;  // serialises connect(); never taken by UCX callbacks
  std::deque<Endpoint> endpoints_;  // deque: stable addresses, ids are indices
  std::unordered_map<std::string, int> endpointByAddress_;

  std::mutex inflightMu_;
  std::unordered_map<Request*, RequestPtr> inflight_;

  std::mutex queueMu_;
  std::vector<std::function<void()>> queue_;
  std::mutex drainMu_;

  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::thread progressThread_;
};

} // namespace transport
} // namespace tdx
