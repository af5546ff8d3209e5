// Pipelined chain broadcast.
//
// Ranks are renumbered relative to the root (v = (r - root) mod N) and form a chain
// 0 -> 1 -> ... -> N-1. The message is cut into K nearly equal chunks of about 256 KiB
// (chainBroadcastChunks). At step s, rank v receives chunk s-v+1 from v-1 and forwards
// chunk s-v, received the step before, to v+1; the root only sends, the last rank only
// receives. Steps: K + N - 2. Bytes: every rank sends and receives S at most once; the
// critical path carries (K + N - 2) chunks, (K + N - 2) / K * S.
// When it wins: large messages across hosts at three or more ranks, where a binomial
// tree's root sends the whole message ceil(log2 N) times and every level waits for the
// one above to finish; here every link carries S once and the levels overlap.
#include <algorithm>

#include "algorithms/collectives.h"

namespace tdx {
namespace algorithms {

namespace {

// Chunks of 256 KiB: enough to overlap the levels of the chain, and small enough for the
// transports' eager path (over TCP, 1 MiB chunks went through UCX's rendezvous handshake
// and ran 2-3x slower on the development VM); past 1024 chunks (256 MiB) they grow
// instead, so the step count stays bounded.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr size_t kMaxChunks = 1024;

} // namespace

size_t chainBroadcastChunks(size_t bytes) {
  const size_t k = (bytes + kChunkBytes - 1) / kChunkBytes;
  return std::min(kMaxChunks, std::max<size_t>(1, k));
}

Plan chainBroadcastPlan(const PlanArgs& a) {
  Plan plan;
  const int n = a.size;
  if (n == 1) return plan;
  const size_t bytes = a.count * a.elemSize;
  // Chunks hold whole elements; chunkBytes (tests) overrides the default cut.
  const size_t elems = a.count;
  size_t k = a.chunkBytes > 0 ? (bytes + a.chunkBytes - 1) / a.chunkBytes
                              : chainBroadcastChunks(bytes);
  k = std::max<size_t>(1, std::min(k, std::max<size_t>(1, elems)));
  auto chunk = [&](long long c) {
    return dataSpan(pieceBegin(elems, k, c) * a.elemSize, pieceCount(elems, k, c) * a.elemSize);
  };
  const int v = (a.rank - a.root + n) % n;
  const int prev = (a.rank - 1 + n) % n, next = (a.rank + 1) % n;
  const long long steps = static_cast<long long>(k) + n - 2;
  const long long kk = static_cast<long long>(k);
  for (long long s = 0; s < steps; ++s) {
    Step st;
    const long long in = s - v + 1, out = s - v;
    if (v > 0 && in >= 0 && in < kk) st.actions.push_back(recvFrom(prev, chunk(in)));
    if (v < n - 1 && out >= 0 && out < kk) st.actions.push_back(sendTo(next, chunk(out)));
    plan.steps.push_back(st);
  }
  return plan;
}

Cost chainBroadcastCost(double bytes, int n) {
  if (n == 1) return {};
  // Negative or NaN sizes (from predict()) count as empty rather than overflowing.
  const double k = static_cast<double>(
      chainBroadcastChunks(bytes > 0 ? static_cast<size_t>(bytes) : size_t{0}));
  const double steps = k + n - 2;
  return {steps, steps / k * bytes, 0};
}

} // namespace algorithms
} // namespace tdx
