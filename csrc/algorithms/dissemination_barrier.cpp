// Dissemination barrier.
//
// ceil(log2 N) rounds: in round k rank r signals r + 2^k and waits for r - 2^k. After
// the last round every rank has (transitively) heard from every other rank, so none can
// leave before all have arrived. Zero-byte messages; no root, no hot spot.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void disseminationBarrier(Channel& ch) {
  const int n = ch.size();
  const int r = ch.rank();
  static char token = 0;
  char sink = 0;
  std::vector<RequestPtr> reqs;
  uint32_t step = 0;
  for (int k = 1; k < n; k <<= 1, ++step) {
    reqs.push_back(ch.isend((r + k) % n, step, &token, 0));
    reqs.push_back(ch.irecv((r - k + n) % n, step, &sink, 0));
    ch.waitAll(reqs);
  }
}

} // namespace algorithms
} // namespace tdx
