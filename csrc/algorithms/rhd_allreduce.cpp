// Recursive halving-doubling all_reduce (Rabenseifner), any world size.
//
// Let p be the largest power of two <= N and q = N - p.
//   0. fold-in (only when q > 0), 1 step: of ranks 0..2q-1, each even rank sends its whole
//      buffer to the odd rank above it, which reduces it; even ranks then sit out.
//   1. reduce-scatter by recursive halving, log2 p steps among the p remaining ranks: at
//      distance d = p/2, p/4, ..., 1 a rank exchanges half of its current window with the
//      partner at (new rank xor d), keeps the half its bit selects and reduces into it.
//      Afterwards new rank i holds the reduction of piece i (of p pieces).
//   2. all-gather by recursive doubling, log2 p steps: windows double back.
//   3. fold-out (q > 0), 1 step: odd ranks return the result to their even neighbour.
// Bytes per active rank: 2(p-1)/p * S each way, plus S each way for folded pairs; reduced:
// (p-1)/p * S (+ S for the fold). Steps: 2 log2 p (+2).
// When it wins: small and medium messages at larger N (log steps instead of 2(N-1));
// power-of-two worlds keep it bandwidth-optimal too.
#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

Plan rhdAllreducePlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size, r = a.rank;
  // An empty op still exchanges (zero-byte) messages: a peer that passed a different
  // count then fails at once on the size, not at the group timeout.
  if (n == 1) return plan;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int q = n - p;
  const size_t all = a.count * a.elemSize;
  const Span whole = dataSpan(0, all);

  // Real rank of new rank i, and this rank's new rank (-1: folded away).
  auto realOf = [&](int i) { return i < q ? 2 * i + 1 : i + q; };
  int me = -1;
  if (r < 2 * q) {
    me = (r % 2 == 1) ? r / 2 : -1;
  } else {
    me = r - q;
  }
  if (q > 0) {
    Step st;
    if (r < 2 * q) {
      st.actions.push_back(r % 2 == 0 ? reducedSendTo(r + 1, whole) : recvReduceFrom(r - 1, whole));
    }
    plan.steps.push_back(st);
  }
  // Pieces [lo, hi) of p pieces as a byte span of Data.
  auto pieces = [&](int lo, int hi) {
    const size_t b = pieceBegin(a.count, p, lo), e = pieceBegin(a.count, p, hi);
    return dataSpan(b * a.elemSize, (e - b) * a.elemSize);
  };
  std::vector<std::pair<int, int>> windows;  // window before each halving step
  int lo = 0, hi = p;
  for (int d = p / 2; d >= 1; d /= 2) {
    Step st;
    if (me >= 0) {
      windows.push_back({lo, hi});
      const int mid = (lo + hi) / 2;
      const int partner = realOf(me ^ d);
      const bool upper = (me & d) != 0;
      const int keepLo = upper ? mid : lo, keepHi = upper ? hi : mid;
      const int giveLo = upper ? lo : mid, giveHi = upper ? mid : hi;
      st.actions.push_back(recvReduceFrom(partner, pieces(keepLo, keepHi)));
      st.actions.push_back(reducedSendTo(partner, pieces(giveLo, giveHi)));
      lo = keepLo;
      hi = keepHi;
    }
    plan.steps.push_back(st);
  }
  for (int d = 1; d < p; d *= 2) {
    Step st;
    if (me >= 0) {
      const auto prev = windows.back();
      windows.pop_back();
      const int partner = realOf(me ^ d);
      // The partner holds the other half of the window we had before this level.
      const int otherLo = lo == prev.first ? hi : prev.first;
      const int otherHi = lo == prev.first ? prev.second : lo;
      st.actions.push_back(recvFrom(partner, pieces(otherLo, otherHi)));
      st.actions.push_back(sendTo(partner, pieces(lo, hi)));
      lo = prev.first;
      hi = prev.second;
    }
    plan.steps.push_back(st);
  }
  if (q > 0) {
    Step st;
    if (r < 2 * q) {
      st.actions.push_back(r % 2 == 1 ? sendTo(r - 1, whole) : recvFrom(r + 1, whole));
    }
    plan.steps.push_back(st);
  }
  return plan;
}

Cost rhdAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  int p = 1, lg = 0;
  while (p * 2 <= n) {
    p *= 2;
    ++lg;
  }
  const bool folded = p != n;
  Cost c;
  c.steps = 2.0 * lg + (folded ? 2 : 0);
  c.bytesMoved = 2.0 * (p - 1) / p * bytes + (folded ? bytes : 0);
  c.bytesReduced = double(p - 1) / p * bytes + (folded ? bytes : 0);
  return c;
}

} // namespace algorithms
} // namespace tdx
