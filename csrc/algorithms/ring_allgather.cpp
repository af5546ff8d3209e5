// Ring allgather.
//
// N-1 steps: at step s rank r sends block (r-s) to r+1 and receives block (r-s-1) from
// r-1, straight into its place in the output. Bytes per rank: (N-1)/N * S sent and
// received (S = total output), the minimum possible; N-1 latency steps.
// When it wins: medium and large messages. Blocks may have different sizes, so the same
// code serves allgather lists and packed outputs.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void ringAllgather(Channel& ch, const std::vector<Block>& blocks) {
  const int n = ch.size();
  const int r = ch.rank();
  const int right = (r + 1) % n;
  const int left = (r - 1 + n) % n;
  std::vector<RequestPtr> reqs;
  for (int s = 0; s < n - 1; ++s) {
    const Block& out = blocks[(r - s + n) % n];
    const Block& in = blocks[(r - s - 1 + n) % n];
    reqs.push_back(ch.isend(right, s, out.data, out.bytes));
    reqs.push_back(ch.irecv(left, s, in.data, in.bytes));
    ch.waitAll(reqs);
  }
}

} // namespace algorithms
} // namespace tdx
