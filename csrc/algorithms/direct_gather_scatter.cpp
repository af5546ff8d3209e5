// Direct gather and scatter.
//
// One step: every non-root rank exchanges its block with the root, which posts all N-1
// transfers at once (and copies its own block locally). Bytes: the root receives (gather)
// or sends (scatter) (N-1)/N * S.
// When it wins: the root's link is the bottleneck either way, so a tree would only save
// latency at large N; the direct form has the fewest steps and copies.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan directGatherPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  Step st;
  if (r != a.root) {
    st.actions.push_back(sendTo(a.root, sendSpan(0, 0, a.sendBytes.at(0))));
  } else {
    for (int i = 0; i < n; ++i) {
      if (i != r) st.actions.push_back(recvFrom(i, recvSpan(i, 0, a.recvBytes.at(i))));
    }
    st.actions.push_back(copy(sendSpan(0, 0, a.sendBytes.at(0)), recvSpan(r, 0, a.recvBytes.at(r))));
  }
  plan.steps.push_back(st);
  return plan;
}

Plan directScatterPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  Step st;
  if (r != a.root) {
    st.actions.push_back(recvFrom(a.root, recvSpan(0, 0, a.recvBytes.at(0))));
  } else {
    for (int i = 0; i < n; ++i) {
      if (i != r) st.actions.push_back(sendTo(i, sendSpan(i, 0, a.sendBytes.at(i))));
    }
    st.actions.push_back(copy(sendSpan(r, 0, a.sendBytes.at(r)), recvSpan(0, 0, a.recvBytes.at(0))));
  }
  plan.steps.push_back(st);
  return plan;
}

Cost directGatherScatterCost(double bytes, int n) {
  if (n == 1) return {};
  return {1.0, double(n - 1) / n * bytes, 0};
}

} // namespace algorithms
} // namespace tdx
