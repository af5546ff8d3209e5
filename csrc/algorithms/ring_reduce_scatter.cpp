// Ring reduce-scatter.
//
// N-1 steps: at step s rank r sends its running partial sum of block (r-s-1) to r+1,
// receives the partial sum of block (r-s-2) from r-1 and adds its own contribution;
// after the last step it holds the full reduction of block r. Inputs are never
// written: partial sums live in two scratch blocks used alternately.
// Bytes per rank: (N-1)/N * S sent and received; N-1 latency steps.
// When it wins: medium and large messages (bandwidth-optimal).
#include <cstring>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void ringReduceScatter(Channel& ch, const std::vector<Block>& inputs, void* output,
                       size_t elemSize, kernels::ReduceFn reduce) {
  const int n = ch.size();
  const int r = ch.rank();
  const size_t bytes = inputs[r].bytes;
  if (n == 1 || bytes == 0) {
    if (bytes > 0 && output != inputs[0].data) std::memmove(output, inputs[0].data, bytes);
    return;
  }
  const size_t count = bytes / elemSize;
  const int right = (r + 1) % n;
  const int left = (r - 1 + n) % n;
  char* bufs = ch.scratch(2 * bytes);
  const char* sendPtr = inputs[(r - 1 + n) % n].data;
  std::vector<RequestPtr> reqs;
  for (int s = 0; s < n - 1; ++s) {
    const int recvIdx = (r - s - 2 + 2 * n) % n;
    char* partial = bufs + (s % 2) * bytes;
    reqs.push_back(ch.isend(right, s, sendPtr, bytes));
    reqs.push_back(ch.irecv(left, s, partial, bytes));
    ch.waitAll(reqs);
    reduce(partial, inputs[recvIdx].data, count);
    sendPtr = partial;
  }
  // The output may alias inputs[r] (in-place reduce_scatter_tensor), so it is written
  // only once every input has been read.
  std::memmove(output, sendPtr, bytes);
}

} // namespace algorithms
} // namespace tdx
