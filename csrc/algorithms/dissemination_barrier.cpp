// Dissemination barrier.
//
// ceil(log2 N) rounds: in round k rank r signals r + 2^k and waits for r - 2^k. After the
// last round every rank has (transitively) heard from every other rank, so none can leave
// before all have arrived. Zero-byte messages; no root, no hot spot.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan disseminationBarrierPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  for (int k = 1; k < n; k *= 2) {
    Step st;
    st.actions.push_back(recvFrom((r - k + n) % n, dataSpan(0, 0)));
    st.actions.push_back(sendTo((r + k) % n, dataSpan(0, 0)));
    plan.steps.push_back(st);
  }
  return plan;
}

Cost disseminationBarrierCost(double /*bytes*/, int n) {
  return {double(ceilLog2(n)), 0, 0};
}

} // namespace algorithms
} // namespace tdx
