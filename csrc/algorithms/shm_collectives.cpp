// Shared-memory collectives (see shm_collectives.h).
//
// Per chunk, every rank: acquire a half (waits until all ranks released its previous
// use), copy in, post, wait, read or reduce what it needs, post, release. Every rank
// posts the same number of times per op, so "all counters >= my counter" means "every
// rank is at least where I am", and the ranks never need to agree on anything else.
//
// Memory traffic per rank for all_reduce of S bytes (shm): copy in the (N-1)/N S others
// reduce, reduce (N-1)/N S of theirs into this rank's own piece in place and publish it
// (S/N), copy out (N-1)/N S; signals: 3 per chunk of half a slot. The direct
// variant reduces all N slots (N-1) S but needs a single signal per chunk on its
// critical path, which wins for small messages.
#include "algorithms/shm_collectives.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tdx {
namespace algorithms {

namespace {

double chunks(double bytes, double per) {
  return std::max(1.0, std::ceil(bytes / per));
}

double halfBytes() {
  return static_cast<double>(HostWindow::defaultSlotBytes() / 2);
}

// Whole elements per half.
size_t chunkElems(const HostWindow& w, size_t elemSize) {
  return std::max<size_t>(1, w.halfBytes() / elemSize);
}

} // namespace

void shmAllreduce(HostWindow& w, const WaitContext& wc, char* data, size_t count,
                  size_t elemSize, kernels::ReduceFn reduce) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    char* src = data + first * elemSize;
    auto at = [&](int q) { return pieceBegin(cnt, n, q) * elemSize; };
    auto len = [&](int q) { return pieceCount(cnt, n, q) * elemSize; };
    const int h = w.acquireHalf(wc);
    char* mine = w.half(r, h);
    // Only the pieces other ranks reduce go into the slot; this rank's own piece is
    // reduced in place in its buffer.
    for (int q = 0; q < n; ++q) {
      if (q != r) std::memcpy(mine + at(q), src + at(q), len(q));
    }
    w.post();
    w.waitAll(w.posted(), wc);
    if (len(r) > 0) {
      for (int q = 0; q < n; ++q) {
        if (q != r) reduce(src + at(r), w.half(q, h) + at(r), len(r) / elemSize);
      }
      // Published for the others; the slot's piece r is not read by anyone until now.
      std::memcpy(mine + at(r), src + at(r), len(r));
    }
    w.post();
    w.waitAll(w.posted(), wc);
    for (int q = 0; q < n; ++q) {
      if (q != r) std::memcpy(src + at(q), w.half(q, h) + at(q), len(q));
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmDirectAllreduce(HostWindow& w, const WaitContext& wc, char* data, size_t count,
                        size_t elemSize, kernels::ReduceFn reduce) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    char* dst = data + first * elemSize;
    const int h = w.acquireHalf(wc);
    std::memcpy(w.half(r, h), dst, cnt * elemSize);
    w.post();
    w.waitAll(w.posted(), wc);
    // Rank order, from slot 0, on every rank: the same bits everywhere.
    std::memcpy(dst, w.half(0, h), cnt * elemSize);
    for (int q = 1; q < n; ++q) reduce(dst, w.half(q, h), cnt);
    w.post();
    w.releaseHalf(h);
  }
}

void shmBroadcast(HostWindow& w, const WaitContext& wc, char* data, size_t bytes, int root) {
  const int r = w.rank();
  const size_t per = w.halfBytes();
  for (size_t off = 0; off < bytes; off += per) {
    const size_t len = std::min(per, bytes - off);
    const int h = w.acquireHalf(wc);
    if (r == root) std::memcpy(w.half(r, h), data + off, len);
    w.post();
    if (r != root) {
      w.waitRank(root, w.posted(), wc);
      std::memcpy(data + off, w.half(root, h), len);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmReduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
               size_t count, size_t elemSize, kernels::ReduceFn reduce, int root) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const int h = w.acquireHalf(wc);
    std::memcpy(w.half(r, h), input + first * elemSize, cnt * elemSize);
    w.post();
    w.waitAll(w.posted(), wc);
    const size_t off = pieceBegin(cnt, n, r) * elemSize;
    const size_t mine = pieceCount(cnt, n, r);
    for (int q = 0; q < n; ++q) {
      if (q != r && mine > 0) reduce(w.half(r, h) + off, w.half(q, h) + off, mine);
    }
    w.post();
    if (r == root) {
      w.waitAll(w.posted(), wc);
      for (int q = 0; q < n; ++q) {
        const size_t o = pieceBegin(cnt, n, q) * elemSize;
        std::memcpy(output + first * elemSize + o, w.half(q, h) + o,
                    pieceCount(cnt, n, q) * elemSize);
      }
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmAllgather(HostWindow& w, const WaitContext& wc, const char* mine,
                  const std::vector<Block>& blocks) {
  const int n = w.size(), r = w.rank();
  const size_t bytes = blocks[r].bytes;
  const size_t per = w.halfBytes();
  for (size_t off = 0; off < bytes; off += per) {
    const size_t len = std::min(per, bytes - off);
    const int h = w.acquireHalf(wc);
    std::memcpy(w.half(r, h), mine + off, len);
    w.post();
    w.waitAll(w.posted(), wc);
    for (int q = 0; q < n; ++q) {
      if (q != r) std::memcpy(blocks[q].data + off, w.half(q, h), len);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmReduceScatter(HostWindow& w, const WaitContext& wc, const std::vector<Block>& inputs,
                      char* output, size_t elemSize, kernels::ReduceFn reduce) {
  const int n = w.size(), r = w.rank();
  const size_t count = inputs[r].bytes / elemSize;
  // Each chunk carries the same range of all N blocks.
  const size_t per = std::max<size_t>(1, w.halfBytes() / n / elemSize);
  for (size_t first = 0; first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const size_t len = cnt * elemSize;
    const int h = w.acquireHalf(wc);
    for (int i = 0; i < n; ++i) {
      std::memcpy(w.half(r, h) + i * len, inputs[i].data + first * elemSize, len);
    }
    w.post();
    w.waitAll(w.posted(), wc);
    char* out = output + first * elemSize;
    std::memcpy(out, w.half(r, h) + r * len, len);
    for (int q = 0; q < n; ++q) {
      if (q != r) reduce(out, w.half(q, h) + r * len, cnt);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmBarrier(HostWindow& w, const WaitContext& wc) {
  w.post();
  w.waitAll(w.posted(), wc);
}

Cost shmAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {3 * chunks(bytes, halfBytes()), double(2 * n - 1) / n * bytes,
          double(n - 1) / n * bytes};
}

Cost shmDirectAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), 2 * bytes, (n - 1) * bytes};
}

Cost shmBroadcastCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), bytes, 0};
}

Cost shmReduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {3 * chunks(bytes, halfBytes()), 2 * bytes, double(n - 1) / n * bytes};
}

Cost shmAllgatherCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes / n, halfBytes()), double(n + 1) / n * bytes, 0};
}

Cost shmReduceScatterCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), double(n + 1) / n * bytes, double(n - 1) / n * bytes};
}

Cost shmBarrierCost(double /*bytes*/, int n) {
  return {n == 1 ? 0.0 : 1.0, 0, 0};
}

} // namespace algorithms
} // namespace tdx
