// Direct gather and scatter.
//
// One step: every non-root rank exchanges its block with the root, which posts all N-1
// transfers at once. Bytes: the root receives (gather) or sends (scatter) (N-1)/N * S.
// When it wins: the root's link is the bottleneck either way, so a tree only saves
// latency at large N; the direct form has the fewest steps and copies.
#include <cstring>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

void directGather(Channel& ch, const Block& mine, const std::vector<Block>& rootBlocks,
                  int root) {
  const int n = ch.size();
  const int r = ch.rank();
  std::vector<RequestPtr> reqs;
  if (r != root) {
    reqs.push_back(ch.isend(root, 0, mine.data, mine.bytes));
  } else {
    for (int i = 0; i < n; ++i) {
      if (i != root) reqs.push_back(ch.irecv(i, 0, rootBlocks[i].data, rootBlocks[i].bytes));
    }
    if (mine.bytes > 0 && mine.data != rootBlocks[root].data) {
      std::memmove(rootBlocks[root].data, mine.data, mine.bytes);
    }
  }
  ch.waitAll(reqs);
}

void directScatter(Channel& ch, const std::vector<Block>& rootBlocks, const Block& mine,
                   int root) {
  const int n = ch.size();
  const int r = ch.rank();
  std::vector<RequestPtr> reqs;
  if (r != root) {
    reqs.push_back(ch.irecv(root, 0, mine.data, mine.bytes));
  } else {
    for (int i = 0; i < n; ++i) {
      if (i != root) reqs.push_back(ch.isend(i, 0, rootBlocks[i].data, rootBlocks[i].bytes));
    }
    if (mine.bytes > 0 && mine.data != rootBlocks[root].data) {
      std::memmove(mine.data, rootBlocks[root].data, mine.bytes);
    }
  }
  ch.waitAll(reqs);
}

} // namespace algorithms
} // namespace tdx
