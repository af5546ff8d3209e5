// Ring all_gather.
//
// N-1 steps: at step s rank r sends block (r-s) to r+1 and receives block (r-s-1) from
// r-1, straight into its place in the output. Bytes per rank: (N-1)/N * S sent and
// received (S = the whole output), the minimum possible; N-1 latency steps.
// When it wins: medium and large messages, and any world size. Blocks may differ in
// size, so the same plan serves all_gather lists and packed outputs.
#include "algorithms/collectives.h"
#include "algorithms/executor.h"

namespace tdx {
namespace algorithms {

Plan ringAllgatherPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  auto block = [&](int i) { return recvSpan(i, 0, a.recvBytes.at(i)); };
  for (int s = 0; s < n - 1; ++s) {
    Step st;
    st.actions.push_back(recvFrom(left, block((r - s - 1 + 2 * n) % n)));
    st.actions.push_back(sendTo(right, block((r - s + n) % n)));
    plan.steps.push_back(st);
  }
  return plan;
}

Cost ringAllgatherCost(double bytes, int n) {
  return {double(n - 1), double(n - 1) / n * bytes, 0};
}

void ringAllgather(Channel& ch, const std::vector<Block>& blocks) {
  PlanArgs a;
  a.rank = ch.rank();
  a.size = ch.size();
  Buffers b;
  for (const auto& blk : blocks) a.recvBytes.push_back(blk.bytes);
  b.recv = blocks;
  runPlan(ch, ringAllgatherPlan(a), b, 1, nullptr, defaultSegmentBytes());
}

int ceilLog2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

bool isPowerOfTwo(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

} // namespace algorithms
} // namespace tdx
