// Pairwise-exchange all_to_all.
//
// A local step copies this rank's own block; then N-1 steps: at step s rank r sends block
// r+s and receives block r-s, so every rank talks to exactly one sender and one receiver
// per step and no link is oversubscribed. Bytes per rank: everything but its own block,
// sent and received once; N-1 steps. Blocks may be any size (uneven or zero splits).
// When it wins: medium and large messages; tiny messages at large N would prefer a
// Bruck algorithm (log N steps), which is not implemented.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan pairwiseAlltoallPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  plan.steps.push_back(Step{{copy(sendSpan(r, 0, a.sendBytes.at(r)), recvSpan(r, 0, a.recvBytes.at(r)))}});
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n, from = (r - s + n) % n;
    Step st;
    st.actions.push_back(recvFrom(from, recvSpan(from, 0, a.recvBytes.at(from))));
    st.actions.push_back(sendTo(to, sendSpan(to, 0, a.sendBytes.at(to))));
    plan.steps.push_back(st);
  }
  return plan;
}

Cost pairwiseAlltoallCost(double bytes, int n) {
  return {double(n - 1), double(n - 1) / n * bytes, 0};
}

} // namespace algorithms
} // namespace tdx
