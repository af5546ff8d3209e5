// Binomial-tree reduce.
//
// The mirror image of the binomial broadcast: with v = (r - root) mod N, in round k
// (m = 2^k) a rank whose low bits below m are zero and whose bit k is set sends its
// partial result to v - m and is done; a rank with v % 2m == 0 receives from v + m (if it
// exists) and reduces. A preliminary local step copies the input into the accumulator
// (the root's output, or scratch), so inputs are never written.
// Steps: ceil(log2 N); bytes: every non-root rank sends S once; the root receives and
// reduces S ceil(log2 N) times.
// When it wins: small and medium messages.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan treeReducePlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size;
  const size_t bytes = a.count * a.elemSize;
  const int v = (a.rank - a.root + n) % n;
  const bool isRoot = v == 0;
  // Leaves (odd v) send their input directly and need no accumulator.
  const bool leaf = v % 2 == 1;
  Span acc = isRoot ? dataSpan(0, bytes) : scratchSpan(0, bytes);
  if (!isRoot && !leaf) plan.scratchBytes = bytes;
  Step init;
  if (!leaf) init.actions.push_back(copy(sendSpan(0, 0, bytes), acc));
  plan.steps.push_back(init);
  bool done = false;
  for (int m = 1; m < n; m *= 2) {
    Step st;
    if (!done) {
      if (v & m) {
        st.actions.push_back(reducedSendTo((v - m + a.root) % n, leaf ? sendSpan(0, 0, bytes) : acc));
        done = true;
      } else if (v + m < n) {
        st.actions.push_back(recvReduceFrom((v + m + a.root) % n, acc));
      }
    }
    plan.steps.push_back(st);
  }
  return plan;
}

Cost treeReduceCost(double bytes, int n) {
  const int l = ceilLog2(n);
  return {double(l), l * bytes, l * bytes};
}

} // namespace algorithms
} // namespace tdx
