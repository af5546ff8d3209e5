// Direct (one-shot) all_reduce.
//
// One step: every rank sends its whole buffer to every other rank and receives theirs into
// scratch slots; then each rank reduces all N contributions itself, in rank order, so every
// rank computes the same bits (floating-point addition is not associative: reducing in
// arrival order would let ranks drift apart).
// Bytes per rank: (N-1) * S sent and as many received; reduced: (N-1) * S; scratch N * S.
// Steps: 1. When it wins: tiny messages, where one round of latency beats everything and
// the N-fold traffic is still negligible.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan directAllreducePlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  // An empty op still exchanges (zero-byte) messages: a peer that passed a different
  // count then fails at once on the size, not at the group timeout.
  if (n == 1) return plan;
  const size_t bytes = a.count * a.elemSize;
  plan.scratchBytes = bytes * n;
  auto slot = [&](int i) { return scratchSpan(static_cast<size_t>(i) * bytes, bytes); };
  Step exchange;
  for (int i = 0; i < n; ++i) {
    if (i != r) exchange.actions.push_back(recvFrom(i, slot(i)));
  }
  for (int i = 0; i < n; ++i) {
    if (i != r) exchange.actions.push_back(sendTo(i, dataSpan(0, bytes)));
  }
  if (r != 0) exchange.actions.push_back(copy(dataSpan(0, bytes), slot(r)));
  plan.steps.push_back(exchange);
  Step combine;
  if (r != 0) combine.actions.push_back(copy(slot(0), dataSpan(0, bytes)));
  for (int i = 1; i < n; ++i) combine.actions.push_back(reduceInto(slot(i), dataSpan(0, bytes)));
  plan.steps.push_back(combine);
  return plan;
}

Cost directAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {1.0, (n - 1) * bytes, (n - 1) * bytes};
}

} // namespace algorithms
} // namespace tdx
