// Pairwise-exchange all-to-all.
//
// N-1 steps: at step s rank r sends block r+s and receives block r-s, so every rank
// talks to exactly one sender and one receiver per step and no link is oversubscribed.
// Bytes per rank: everything but its own block, sent and received once; N-1 steps.
// Blocks may be any size (uneven splits, zero-size splits).
// When it wins: medium and large messages; tiny messages at large N prefer a Bruck
// algorithm (log N steps), not implemented yet.
#include <cstring>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void pairwiseAlltoall(Channel& ch, const std::vector<Block>& sends,
                      const std::vector<Block>& recvs) {
  const int n = ch.size();
  const int r = ch.rank();
  if (sends[r].bytes > 0 && sends[r].data != recvs[r].data) {
    std::memmove(recvs[r].data, sends[r].data, sends[r].bytes);
  }
  std::vector<RequestPtr> reqs;
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    const int from = (r - s + n) % n;
    reqs.push_back(ch.isend(to, s, sends[to].data, sends[to].bytes));
    reqs.push_back(ch.irecv(from, s, recvs[from].data, recvs[from].bytes));
    ch.waitAll(reqs);
  }
}

} // namespace algorithms
} // namespace tdx
