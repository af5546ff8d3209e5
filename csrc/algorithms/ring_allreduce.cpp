// Ring allreduce (reduce-scatter, then allgather, around a ring).
//
// Phases: the buffer is cut into N chunks (sizes differ by at most one element).
//   1. reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s) to r+1, receives
//      chunk (r-s-1) from r-1 and reduces it into place; afterwards rank r holds the
//      full reduction of chunk (r+1).
//   2. allgather, N-1 steps: rank r forwards the finished chunk it last received.
// Bytes on the wire per rank: 2(N-1)/N * S sent and received; 2(N-1) latency steps.
// When it wins: large messages, where bandwidth dominates (it is bandwidth-optimal);
// its 2(N-1) steps make it a poor choice for small messages at large N.
#include <algorithm>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void ringAllreduce(Channel& ch, void* data, size_t count, size_t elemSize,
                   kernels::ReduceFn reduce) {
  const int n = ch.size();
  const int r = ch.rank();
  if (n == 1 || count == 0) return;

  const size_t base = count / n;
  const size_t extra = count % n;
  auto chunkCount = [&](int i) { return base + (static_cast<size_t>(i) < extra ? 1 : 0); };
  auto chunkPtr = [&](int i) {
    size_t off = static_cast<size_t>(i) * base + std::min(static_cast<size_t>(i), extra);
    return static_cast<char*>(data) + off * elemSize;
  };
  char* tmp = ch.scratch(chunkCount(0) * elemSize);
  const int right = (r + 1) % n;
  const int left = (r - 1 + n) % n;
  std::vector<RequestPtr> reqs;

  for (int s = 0; s < n - 1; ++s) {
    int sendIdx = (r - s + n) % n;
    int recvIdx = (r - s - 1 + n) % n;
    reqs.push_back(ch.isend(right, s, chunkPtr(sendIdx), chunkCount(sendIdx) * elemSize));
    reqs.push_back(ch.irecv(left, s, tmp, chunkCount(recvIdx) * elemSize));
    ch.waitAll(reqs);
    reduce(chunkPtr(recvIdx), tmp, chunkCount(recvIdx));
  }
  for (int s = 0; s < n - 1; ++s) {
    int sendIdx = (r + 1 - s + n) % n;
    int recvIdx = (r - s + n) % n;
    reqs.push_back(ch.isend(right, n + s, chunkPtr(sendIdx), chunkCount(sendIdx) * elemSize));
    reqs.push_back(ch.irecv(left, n + s, chunkPtr(recvIdx), chunkCount(recvIdx) * elemSize));
    ch.waitAll(reqs);
  }
}

} // namespace algorithms
} // namespace tdx
