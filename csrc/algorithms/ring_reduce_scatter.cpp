// Ring reduce_scatter.
//
// N-1 steps: at step s rank r sends its running partial of block (r-s-1) to r+1 (at s = 0
// its own input), receives the partial of block (r-s-2) from r-1 into scratch and adds
// its contribution; after the last step it holds the full reduction of block r, which a
// final local copy moves to the output. Partials alternate between two scratch blocks,
// so inputs are never written and the output may alias an input block.
// Bytes per rank: (N-1)/N * S sent and received (S = all input blocks); reduced the
// same; N-1 latency steps.
// When it wins: medium and large messages, any world size (bandwidth-optimal).
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan ringReduceScatterPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  const size_t b = a.recvBytes.at(0);
  if (n == 1) {
    plan.steps.push_back(Step{{copy(sendSpan(0, 0, b), recvSpan(0, 0, b))}});
    return plan;
  }
  plan.scratchBytes = 2 * b;
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  Span sending = sendSpan((r - 1 + n) % n, 0, b);
  for (int s = 0; s < n - 1; ++s) {
    const int idx = (r - s - 2 + 2 * n) % n;
    const Span partial = scratchSpan((s % 2) * b, b);
    Step st;
    st.actions.push_back(recvFrom(left, partial));
    st.actions.push_back(sendTo(right, sending));
    st.actions.push_back(reduceInto(sendSpan(idx, 0, b), partial));
    plan.steps.push_back(st);
    sending = partial;
  }
  plan.steps.push_back(Step{{copy(sending, recvSpan(0, 0, b))}});
  return plan;
}

Cost ringReduceScatterCost(double bytes, int n) {
  return {double(n - 1), double(n - 1) / n * bytes, double(n - 1) / n * bytes};
}

} // namespace algorithms
} // namespace tdx
