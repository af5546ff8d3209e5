// Binomial-tree broadcast.
//
// Ranks are renumbered relative to the root (v = (r - root) mod N). Rank v receives
// once, from v minus its lowest set bit, then sends to v + 2^k for every 2^k below that
// bit. Steps: ceil(log2 N); bytes: each non-root rank receives S once, and the root
// sends S to ceil(log2 N) children.
// When it wins: small and medium messages (log N latency). For very large messages a
// pipelined chain or scatter+allgather moves fewer bytes per link.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void treeBroadcast(Channel& ch, void* data, size_t bytes, int root) {
  const int n = ch.size();
  if (n == 1) return;
  const int v = (ch.rank() - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      int parent = (v - mask + root) % n;
      auto req = ch.irecv(parent, 0, data, bytes);
      ch.wait(req);
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  std::vector<RequestPtr> reqs;
  while (mask > 0) {
    if (v + mask < n) {
      reqs.push_back(ch.isend((v + mask + root) % n, 0, data, bytes));
    }
    mask >>= 1;
  }
  ch.waitAll(reqs);
}

} // namespace algorithms
} // namespace tdx
