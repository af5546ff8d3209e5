// Binomial-tree reduce.
//
// The mirror image of the binomial broadcast: with v = (r - root) mod N, at round k a
// rank whose bit k is set sends its partial result to v - 2^k and leaves; the others
// receive from v + 2^k (if it exists) and reduce. Steps: ceil(log2 N); bytes: every
// non-root rank sends S once; the root receives and reduces ceil(log2 N) times S.
// When it wins: small and medium messages. Large reductions are cheaper as
// reduce-scatter + gather (bandwidth-optimal), left to the algorithms registry.
#include <cstring>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void treeReduce(Channel& ch, const void* input, void* output, size_t count, size_t elemSize,
                kernels::ReduceFn reduce, int root) {
  const int n = ch.size();
  const int r = ch.rank();
  const size_t bytes = count * elemSize;
  if (n == 1 || count == 0) {
    if (r == root && output != input && bytes > 0) std::memmove(output, input, bytes);
    return;
  }
  const int v = (r - root + n) % n;
  // The root accumulates in its output; other ranks in scratch, leaving input intact.
  char* scratch = ch.scratch(2 * bytes);
  char* acc = (r == root) ? static_cast<char*>(output) : scratch;
  char* tmp = scratch + bytes;
  if (acc != input) std::memmove(acc, input, bytes);

  for (int mask = 1; mask < n; mask <<= 1) {
    if ((v & mask) == 0) {
      int childV = v | mask;
      if (childV < n) {
        auto req = ch.irecv((childV + root) % n, 0, tmp, bytes);
        ch.wait(req);
        reduce(acc, tmp, count);
      }
    } else {
      auto req = ch.isend(((v & ~mask) + root) % n, 0, acc, bytes);
      ch.wait(req);
      break;
    }
  }
}

} // namespace algorithms
} // namespace tdx
