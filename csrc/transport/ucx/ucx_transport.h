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
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace tdx {
namespace transport {

class UcxTransport final : public Transport {
 public:
  // The process-wide instance, created on first use and destroyed when the last
  // holder lets go (so destroy + init in one process starts afresh).
  static std::shared_ptr<UcxTransport> acquire();

  UcxTransport();
  ~UcxTransport() override;

  std::string address() const override;
  int connect(const std::string& address) override;
  RequestPtr isend(int endpoint, uint64_t tag, const void* data, size_t bytes, MemType mem,
                   std::function<void(Request&)> onComplete) override;
  RequestPtr irecv(int endpoint, uint64_t tag, uint64_t tagMask, void* data, size_t bytes,
                   MemType mem, std::function<void(Request&)> onComplete) override;
  bool wait(Request& request, Clock::time_point deadline) override;
  void cancel(Request& request, const std::string& reason) override;
  bool endpointFailed(int endpoint) const override;
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
  };

  RequestPtr track(int endpoint, bool isSend, std::function<void(Request&)> onComplete);
  void finishImmediately(const RequestPtr& r, ucs_status_t status, size_t length,
                         uint64_t senderTag);
  void finishRequest(Request& r, bool ok, const std::string& error);
  void defer(std::function<void()> action);
  void drain();
  void progressLoop();
  void wake();
  void closeEndpoints();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int eventFd_ = -1;
  int epollFd_ = -1;
  std::chrono::microseconds spin_;

  mutable std::mutex endpointsMu_;
  std::atomic<uint64_t> failedEndpoints_{0};
  bool peerErrors_;  // UCP_ERR_HANDLING_MODE_PEER on endpoints (TDX_UCX_PEER_ERRORS)
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
