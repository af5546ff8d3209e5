// UCX's reports of what a worker still held when it was destroyed, counted instead of
// printed. A transport that stops after a peer was lost or a transfer was given up on
// (transport.h, abandon) leaves UCX requests it could not finish, memory registered for
// them and messages nobody received. UCX prints a warning for each as the worker and
// context go ("object ... was not returned to mpool ucp_requests" or "... mm_recv_desc",
// "ucp_rcache: destroying inuse region", "unexpected tag-receive descriptor ... was not
// matched"): raw lines, one per object, after the backend's own error already named the
// peer and the op. While a StopReportsCounter lives on a thread, those three reports
// made on that thread are counted instead; any other UCX message passes through.
#pragma once

#include <cstddef>

namespace tdx {
namespace transport {

class StopReportsCounter {
 public:
  struct Counts {
    size_t objects = 0;   // requests and buffers not returned to UCX's pools
    size_t regions = 0;   // registered memory regions still in use
    size_t messages = 0;  // messages that arrived and were never received
    size_t total() const {
      return objects + regions + messages;
    }
  };

  StopReportsCounter();
  ~StopReportsCounter();
  StopReportsCounter(const StopReportsCounter&) = delete;
  StopReportsCounter& operator=(const StopReportsCounter&) = delete;

  const Counts& counts() const {
    return counts_;
  }

 private:
  Counts counts_;
};

} // namespace transport
} // namespace tdx
