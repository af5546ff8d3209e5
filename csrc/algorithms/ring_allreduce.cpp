// Ring all_reduce (reduce-scatter, then all-gather, around a ring).
//
// Phases: the buffer is cut into N chunks (sizes differ by at most one element).
//   1. reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s) to r+1 and receives
//      chunk (r-s-1) from r-1, reducing it into place; afterwards rank r holds the full
//      reduction of chunk (r+1).
//   2. all-gather, N-1 steps: rank r forwards the finished chunk it last received.
// Bytes on the wire per rank: 2(N-1)/N * S sent and as many received; reduced: (N-1)/N * S.
// Steps: 2(N-1). Every chunk is reduced by one rank only, so all ranks end bit-identical.
// When it wins: large messages, where bandwidth dominates (it is bandwidth-optimal);
// its 2(N-1) latency steps lose to rhd or direct for small messages.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan ringAllreducePlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  // An empty op still exchanges (zero-byte) messages: a peer that passed a different
  // count then fails at once on the size, not at the group timeout.
  if (n == 1) return plan;
  auto chunk = [&](int i) {
    return dataSpan(pieceBegin(a.count, n, i) * a.elemSize, pieceCount(a.count, n, i) * a.elemSize);
  };
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int s = 0; s < n - 1; ++s) {
    Step st;
    st.actions.push_back(recvReduceFrom(left, chunk((r - s - 1 + 2 * n) % n)));
    st.actions.push_back(reducedSendTo(right, chunk((r - s + n) % n)));
    plan.steps.push_back(st);
  }
  for (int s = 0; s < n - 1; ++s) {
    Step st;
    st.actions.push_back(recvFrom(left, chunk((r - s + n) % n)));
    st.actions.push_back(sendTo(right, chunk((r + 1 - s + n) % n)));
    plan.steps.push_back(st);
  }
  return plan;
}

Cost ringAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {2.0 * (n - 1), 2.0 * (n - 1) / n * bytes, double(n - 1) / n * bytes};
}

} // namespace algorithms
} // namespace tdx
