// Recursive-doubling all_gather (power-of-two worlds).
//
// log2 N steps: at distance d = 1, 2, 4, ... rank r exchanges everything it holds (the d
// blocks of its aligned group) with rank r xor d, doubling what it holds.
// Bytes per rank: (N-1)/N * S sent and received, like the ring, in log2 N steps.
// When it wins: small and medium messages at larger N. Non-power-of-two worlds use the
// ring (the registry enforces the constraint).
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan rdAllgatherPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  for (int d = 1; d < n; d *= 2) {
    Step st;
    const int partner = r ^ d;
    const int mine = r & ~(d - 1), theirs = partner & ~(d - 1);
    for (int i = 0; i < d; ++i) {
      st.actions.push_back(recvFrom(partner, recvSpan(theirs + i, 0, a.recvBytes.at(theirs + i))));
    }
    for (int i = 0; i < d; ++i) {
      st.actions.push_back(sendTo(partner, recvSpan(mine + i, 0, a.recvBytes.at(mine + i))));
    }
    plan.steps.push_back(st);
  }
  return plan;
}

Cost rdAllgatherCost(double bytes, int n) {
  return {double(ceilLog2(n)), double(n - 1) / n * bytes, 0};
}

} // namespace algorithms
} // namespace tdx
