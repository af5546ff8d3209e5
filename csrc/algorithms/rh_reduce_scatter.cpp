// Recursive-halving reduce_scatter (power-of-two worlds).
//
// A local step copies the N input blocks into scratch. Then log2 N steps: at distance
// d = N/2, ..., 1 rank r sends the half of its current window of blocks that the partner
// (r xor d) keeps and reduces the half it keeps with what the partner sends. The window
// ends as block r alone, which a final local copy moves to the output.
// Bytes per rank: (N-1)/N * S sent and received; reduced the same; log2 N steps (plus
// one local copy of S).
// When it wins: small and medium messages at larger N.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan rhReduceScatterPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  const size_t b = a.recvBytes.at(0);
  plan.scratchBytes = b * n;
  Step init;
  for (int i = 0; i < n; ++i) init.actions.push_back(copy(sendSpan(i, 0, b), scratchSpan(i * b, b)));
  plan.steps.push_back(init);
  int lo = 0, hi = n;
  for (int d = n / 2; d >= 1; d /= 2) {
    const int mid = (lo + hi) / 2;
    const bool upper = (r & d) != 0;
    const int keepLo = upper ? mid : lo, keepHi = upper ? hi : mid;
    const int giveLo = upper ? lo : mid, giveHi = upper ? mid : hi;
    Step st;
    st.actions.push_back(recvReduceFrom(r ^ d, scratchSpan(keepLo * b, (keepHi - keepLo) * b)));
    st.actions.push_back(reducedSendTo(r ^ d, scratchSpan(giveLo * b, (giveHi - giveLo) * b)));
    plan.steps.push_back(st);
    lo = keepLo;
    hi = keepHi;
  }
  plan.steps.push_back(Step{{copy(scratchSpan(r * b, b), recvSpan(0, 0, b))}});
  return plan;
}

Cost rhReduceScatterCost(double bytes, int n) {
  return {double(ceilLog2(n)), double(n - 1) / n * bytes, double(n - 1) / n * bytes};
}

} // namespace algorithms
} // namespace tdx
