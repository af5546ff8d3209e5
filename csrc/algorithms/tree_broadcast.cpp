// Binomial-tree broadcast.
//
// Ranks are renumbered relative to the root (v = (r - root) mod N). In round i, with
// m = 2^(L-1-i) and L = ceil(log2 N), every rank with v % 2m == 0 that has the data sends
// it to v + m (if that rank exists), which receives it. Steps: L; bytes: each non-root
// rank receives S once; the root sends S L times.
// When it wins: small and medium messages (log N latency).
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan treeBroadcastPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size;
  if (n == 1) return plan;
  const size_t bytes = a.count * a.elemSize;
  const int v = (a.rank - a.root + n) % n;
  const int rounds = ceilLog2(n);
  for (int i = 0; i < rounds; ++i) {
    const int m = 1 << (rounds - 1 - i);
    Step st;
    if (v % (2 * m) == 0 && v + m < n) {
      st.actions.push_back(sendTo((v + m + a.root) % n, dataSpan(0, bytes)));
    } else if (v % (2 * m) == m) {
      st.actions.push_back(recvFrom((v - m + a.root) % n, dataSpan(0, bytes)));
    }
    plan.steps.push_back(st);
  }
  return plan;
}

Cost treeBroadcastCost(double bytes, int n) {
  const int l = ceilLog2(n);
  return {double(l), l * bytes, 0};
}

} // namespace algorithms
} // namespace tdx
