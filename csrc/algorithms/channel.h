// What an algorithm sees of the network: ranks 0..size-1 of one group and tagged
// byte transfers between them for one operation. No UCX and no torch here; the c10d
// layer implements this over a Transport, tests can implement it over anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport/transport.h"

namespace tdx {
namespace algorithms {

using transport::RequestPtr;

// A contiguous byte range of one rank's buffer.
struct Block {
  char* data = nullptr;
  size_t bytes = 0;
};

class Channel {
 public:
  virtual ~Channel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // `step` tells transfers of one op apart (it is part of the tag).
  virtual RequestPtr isend(int peer, uint32_t step, const void* data, size_t bytes) = 0;
  virtual RequestPtr irecv(int peer, uint32_t step, void* data, size_t bytes) = 0;

  // Waits for completion; throws (naming the peer and step) on failure or deadline.
  // A receive that got fewer bytes than posted is an error too.
  virtual void wait(const RequestPtr& request) = 0;

  // Scratch memory for the op, at least `bytes`, contents unspecified. A larger request
  // may move it: earlier pointers are invalid after one.
  virtual char* scratch(size_t bytes) = 0;

  void waitAll(std::vector<RequestPtr>& requests) {
    for (auto& r : requests) wait(r);
    requests.clear();
  }
};

} // namespace algorithms
} // namespace tdx
