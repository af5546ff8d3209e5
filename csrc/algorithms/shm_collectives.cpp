// Shared-memory collectives (see shm_collectives.h).
//
// Per chunk, every rank: acquire a half (waits until all ranks released its previous
// use), copy in, post, wait, read or reduce what it needs, post, release. Every rank
// posts the same number of times per op, so "all counters >= my counter" means "every
// rank is at least where I am", and the ranks never need to agree on anything else.
//
// Memory traffic per rank for all_reduce of S bytes (shm): copy in the (N-1)/N S others
// reduce, reduce (N-1)/N S of theirs into this rank's own piece and publish it (S/N),
// copy out (N-1)/N S; signals: 3 per chunk of half a slot. Reductions go a 16 KiB
// block at a time across every peer ready by then, so the piece is written once per
// run of ready peers (once when all are ready), not once per peer. The direct
// variant reduces all N slots (N-1) S but needs a single signal per chunk on its
// critical path, which wins for small messages. With TDX_SHM_THREADS above 1 the shm
// all_reduce splits each of its passes (copy in, reduce, copy out) over helper threads
// (pass_pool.h), and so does the cma all_reduce (its reads of peers' pieces, reduced a
// staged block at a time through every peer); the signals stay on the calling thread.
#include "algorithms/shm_collectives.h"

#include "algorithms/pass_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdx {
namespace algorithms {

namespace {

double chunks(double bytes, double per) {
  return std::max(1.0, std::ceil(bytes / per));
}

double halfBytes() {
  return static_cast<double>(HostWindow::defaultSlotBytes() / 2);
}

enum Kind : uint64_t {
  kAllreduce = 1,
  kDirectAllreduce,
  kBroadcast,
  kReduce,
  kAllgather,
  kReduceScatter,
  kAlltoall,
  kGather,
  kScatter,
  kBarrier,
  kCmaAllreduce,
  kDirectReduce,
};

const char* kindName(uint64_t k) {
  static const char* const names[] = {"?",       "all_reduce (shm)", "all_reduce (shm_direct)",
                                      "broadcast", "reduce",         "all_gather",
                                      "reduce_scatter", "all_to_all", "gather",
                                      "scatter",   "barrier",        "all_reduce (cma)",
                                      "reduce (shm_direct)"};
  return k < sizeof(names) / sizeof(names[0]) ? names[k] : "?";
}

// The detail as written by a peer: bounded, whatever its last byte holds.
std::string detailText(const HostWindow::OpInfo& i) {
  return std::string(i.detail, strnlen(i.detail, sizeof(i.detail)));
}

std::string describe(const HostWindow::OpInfo& i) {
  std::string d = std::string(kindName(i.kind)) + " of " + std::to_string(i.bytes) + " bytes";
  if (i.detail[0] != '\0') d += " (" + detailText(i) + ")";
  if (i.root >= 0) d += " (root " + std::to_string(i.root) + ")";
  return d;
}

// First chunk of an op, before its first post: say what this rank called.
void announce(HostWindow& w, int h, uint64_t kind, uint64_t bytes, int root = -1) {
  w.setOpInfo(h, HostWindow::OpInfo{kind, root, bytes});
}

// After the first wait: every rank in `peers` (all others when empty) must have called
// the same op on the same size.
void verify(HostWindow& w, int h, int only = -1) {
  const HostWindow::OpInfo mine = w.opInfo(w.rank(), h);
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.rank() || (only >= 0 && q != only)) continue;
    const HostWindow::OpInfo theirs = w.opInfo(q, h);
    if (theirs.seq != mine.seq) {
      throw std::runtime_error(
          "collective mismatch: rank " + std::to_string(q) + " is at op #" +
          std::to_string(theirs.seq) + " of this group (" + describe(theirs) +
          ") but this rank (" + std::to_string(w.rank()) + ") at op #" +
          std::to_string(mine.seq) + " (" + describe(mine) +
          "): an op failed or was skipped on only some ranks, e.g. one pinned an algorithm "
          "the others did not. Every rank must issue the same collectives in the same "
          "order, with the same pins");
    }
    if (theirs.kind != mine.kind || theirs.bytes != mine.bytes || theirs.root != mine.root ||
        std::strncmp(theirs.detail, mine.detail, sizeof(mine.detail)) != 0) {
      throw std::runtime_error("collective mismatch: rank " + std::to_string(q) + " called " +
                               describe(theirs) + " but this rank (" +
                               std::to_string(w.rank()) + ") called " + describe(mine) +
                               ". Every rank must call the same collectives with tensors of "
                               "the same size and dtype, and the same root, reduce op and "
                               "algorithm");
    }
  }
}

// A rank whose role never waits for a peer (a broadcast's or a scatter's root, a
// gather's or a direct reduce's other ranks) checks, on the op's first chunk after its
// first post, the calls of the ranks it depends on (all of them, or `only`) that have
// reached the op by then, without waiting for the others: waiting would cost every such
// op a round trip. Of two ranks that both believe they are the root, the later one
// finds the other already there and raises; its notice then fails the other's next op.
void checkArrived(HostWindow& w, int h, int only = -1) {
  const uint64_t target = w.posted();
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.rank() || (only >= 0 && q != only)) continue;
    if (w.reached(q, target)) verify(w, h, q);
  }
}

// Whole elements per half.
size_t chunkElems(const HostWindow& w, size_t elemSize) {
  return std::max<size_t>(1, w.halfBytes() / elemSize);
}

// Reduction blocks: small enough that a block of the result stays in L1 while every
// ready peer's block is folded into it, so a run of peers costs one pass over memory
// instead of one per peer.
constexpr size_t kReduceBlockBytes = 16 << 10;
// cma's reads of a peer's piece go through a staging buffer of this size, a block at a
// time: big enough that a read's system call is a small part of its time, small enough
// that the block and the piece's block it is reduced into stay in a core's cache.
constexpr size_t kCmaStageBytes = 128 << 10;

// dst = own (through `load`, which scales where the op does) reduced with each peer's
// data, `bytes` of it, each block finished by `load` once final (AVG's division), in the
// fixed order (r + 1) % n, (r + 2) % n, ..., so the result's bits do not depend on
// timing. Peers are taken as they become ready (with more ranks
// than cores, whoever runs makes progress): wait for the next one in order, then take
// every following one that has posted `target` as well, and fold that run in a block at
// a time. `publish`, when set, receives a copy of the result block by block during the
// last run, while each block is still in cache. `verifyPeers`: on the op's first chunk.
template <class PeerData>
void reduceAsReady(HostWindow& w, const WaitContext& wc, int h, uint64_t target,
                   bool verifyPeers, const char* own, char* dst, size_t bytes,
                   size_t elemSize, kernels::ReduceFn reduce, const kernels::Load& load,
                   const PeerData& peerData, char* publish, int ways = 1) {
  const int n = w.size(), r = w.rank();
  const size_t block = std::max(elemSize, kReduceBlockBytes / elemSize * elemSize);
  bool loaded = false;
  for (int next = 1; next < n || !loaded;) {
    int end = next;  // this run: peers (r + k) % n for k in [next, end)
    if (next < n) {
      w.waitRank((r + next) % n, target, wc);
      end = next + 1;
      while (end < n && w.reached((r + end) % n, target)) ++end;
      if (verifyPeers) {
        for (int k = next; k < end; ++k) verify(w, h, (r + k) % n);
      }
    }
    const bool last = end == n;
    // Threads split the blocks, never one block: cuts fall on multiples of `block`.
    parallelPass(bytes, block, ways, [&](size_t from, size_t to) {
      for (size_t off = from; off < to; off += block) {
        const size_t b = std::min(block, to - off);
        if (!loaded) load(dst + off, own + off, b);
        for (int k = next; k < end; ++k) {
          reduce(dst + off, peerData((r + k) % n) + off, b / elemSize);
        }
        if (last) load.finish(dst + off, b);
        if (last && publish != nullptr) std::memcpy(publish + off, dst + off, b);
      }
    });
    loaded = true;
    next = end;
  }
}

// fn(begin, end) over [0, total) less [skip, skip + skipBytes), split over `ways`
// threads: a rank's copies into and out of the window cover every piece but its own.
template <class Fn>
void allButPiece(size_t skip, size_t skipBytes, size_t total, size_t grain, int ways,
                 const Fn& fn) {
  parallelPass(total - skipBytes, grain, ways, [&](size_t from, size_t to) {
    if (from < skip) fn(from, std::min(to, skip));
    if (to > skip) fn(std::max(from, skip) + skipBytes, to + skipBytes);
  });
}

} // namespace

void shmAllreduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
                  size_t count, size_t elemSize, kernels::ReduceFn reduce,
                  const kernels::Load& load) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  const int ways = w.passThreads();
  const size_t grain = std::max(elemSize, kReduceBlockBytes / elemSize * elemSize);
  for (size_t first = 0; first == 0 || first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const char* src = input + first * elemSize;
    char* dst = output + first * elemSize;
    auto at = [&](int q) { return pieceBegin(cnt, n, q) * elemSize; };
    auto len = [&](int q) { return pieceCount(cnt, n, q) * elemSize; };
    const int h = w.acquireHalf(wc);
    if (first == 0) announce(w, h, kAllreduce, count * elemSize);
    char* mine = w.half(r, h);
    // Only the pieces other ranks reduce go into the slot; this rank's own piece is
    // reduced in place in the output.
    allButPiece(at(r), len(r), cnt * elemSize, grain, ways,
                [&](size_t b, size_t e) { load(mine + b, src + b, e - b); });
    w.post();
    // This rank's piece: its own input reduced with the peers' as they become ready,
    // and published for the others (the slot's piece r is read by no one until then).
    const uint64_t copied = w.posted();
    reduceAsReady(w, wc, h, copied, first == 0, src + at(r), dst + at(r), len(r), elemSize,
                  reduce, load, [&](int q) { return w.half(q, h) + at(r); }, mine + at(r),
                  ways);
    w.post();
    const uint64_t reduced = w.posted();
    if (ways <= 1) {
      // One thread: each piece as soon as its rank has published it.
      for (int k = 1; k < n; ++k) {
        const int q = (r + k) % n;
        w.waitRank(q, reduced, wc);
        std::memcpy(dst + at(q), w.half(q, h) + at(q), len(q));
      }
    } else {
      // Several: every piece published first, then one pass split over the threads,
      // each range copied from the slots of the ranks whose pieces it covers.
      for (int k = 1; k < n; ++k) w.waitRank((r + k) % n, reduced, wc);
      allButPiece(at(r), len(r), cnt * elemSize, grain, ways, [&](size_t b, size_t e) {
        for (int q = 0; q < n; ++q) {
          const size_t lo = std::max(b, at(q)), hi = std::min(e, at(q) + len(q));
          if (lo < hi) std::memcpy(dst + lo, w.half(q, h) + lo, hi - lo);
        }
      });
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmDirectAllreduce(HostWindow& w, const WaitContext& wc, const char* input,
                        char* output, size_t count, size_t elemSize,
                        kernels::ReduceFn reduce, const kernels::Load& load) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first == 0 || first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const char* src = input + first * elemSize;
    char* dst = output + first * elemSize;
    const int h = w.acquireHalf(wc);
    if (first == 0) announce(w, h, kDirectAllreduce, count * elemSize);
    load(w.half(r, h), src, cnt * elemSize);
    w.post();
    w.waitAll(w.posted(), wc);
    if (first == 0) verify(w, h);
    if (cnt == 0) {
      w.post();
      w.releaseHalf(h);
      continue;
    }
    // Rank order, from slot 0, on every rank: the same bits everywhere. A block at a
    // time, so it stays in L1 across the slots.
    const size_t block = std::max<size_t>(1, kReduceBlockBytes / elemSize);
    for (size_t e = 0; e < cnt; e += block) {
      const size_t b = std::min(block, cnt - e);
      std::memcpy(dst + e * elemSize, w.half(0, h) + e * elemSize, b * elemSize);
      for (int q = 1; q < n; ++q) reduce(dst + e * elemSize, w.half(q, h) + e * elemSize, b);
      load.finish(dst + e * elemSize, b * elemSize);
    }
    w.post();
    w.releaseHalf(h);
  }
}

// Reads of peers' memory split over the pass's threads. A helper may not throw (nor
// touch the window's state), so each part records the first read that failed, the
// others skip what is left of theirs, and the caller throws for it once the pass is over.
class CmaReads {
 public:
  explicit CmaReads(HostWindow& w) : w_(w) {}
  // False once any read of the pass failed: the part stops.
  bool read(int q, const char* remote, char* local, size_t bytes) {
    if (failed_.load(std::memory_order_relaxed)) return false;
    const int error = w_.tryReadFrom(q, remote, local, bytes);
    if (error == 0) return true;
    int expected = -1;
    if (peer_.compare_exchange_strong(expected, q)) error_ = error;
    failed_.store(true, std::memory_order_release);
    return false;
  }
  bool failed() const {
    return failed_.load(std::memory_order_relaxed);
  }
  // After the pass, on the caller's thread.
  void throwIfFailed(const WaitContext& wc) {
    if (failed_.load(std::memory_order_acquire)) w_.readFailed(peer_.load(), error_, wc);
  }

 private:
  HostWindow& w_;
  std::atomic<bool> failed_{false};
  std::atomic<int> peer_{-1};
  int error_ = 0;  // written by the part that set peer_, read after the pass
};

void cmaAllreduce(HostWindow& w, const WaitContext& wc, char* data, size_t count,
                  size_t elemSize, kernels::ReduceFn reduce, const kernels::Load& load) {
  const int n = w.size(), r = w.rank();
  const int ways = w.passThreads();
  auto at = [&](int q) { return pieceBegin(count, n, q) * elemSize; };
  auto len = [&](int q) { return pieceCount(count, n, q) * elemSize; };
  // The window's half carries only the op info (with this rank's buffer address).
  const int h = w.acquireHalf(wc);
  w.setOpInfo(h, HostWindow::OpInfo{kCmaAllreduce, -1, count * elemSize,
                                    reinterpret_cast<uint64_t>(data)});
  w.post();
  const uint64_t published = w.posted();
  // Peers' pieces land in a small staging buffer that stays in cache, and are reduced
  // into this rank's own piece of its buffer (a buffer per thread, helpers included).
  const size_t stage = std::max(elemSize, kCmaStageBytes / elemSize * elemSize);
  const size_t grain = std::max(elemSize, kReduceBlockBytes / elemSize * elemSize);
  auto staging = [stage]() {
    static thread_local std::vector<char> buffer;
    if (buffer.size() < stage) buffer.resize(stage);
    return buffer.data();
  };
  // Every address first, then one pass over this rank's piece (split over the threads
  // when there are several), a staged block at a time through every peer, so each block
  // of the piece is read and written once, not once per peer, and stays in cache
  // meanwhile. Peers are reduced in rank order from r + 1 for every block, whatever the
  // split: the same bits with any number of threads.
  std::vector<const char*> theirs(n, nullptr);
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    w.waitRank(q, published, wc);
    verify(w, h, q);
    theirs[q] = reinterpret_cast<const char*>(w.opInfo(q, h).address);
  }
  CmaReads reduceReads(w);
  parallelPass(len(r), grain, ways, [&](size_t from, size_t to) {
    char* buffer = staging();
    for (size_t off = from; off < to && !reduceReads.failed(); off += stage) {
      const size_t b = std::min(stage, to - off);
      for (int k = 1; k < n; ++k) {
        const int q = (r + k) % n;
        if (!reduceReads.read(q, theirs[q] + at(r) + off, buffer, b)) return;
        reduce(data + at(r) + off, buffer, b / elemSize);
      }
      // No peer reads this rank's own piece before the post below.
      load.finish(data + at(r) + off, b);
    }
  });
  reduceReads.throwIfFailed(wc);
  w.post();
  const uint64_t reduced = w.posted();
  // Every reduced piece, read straight into this rank's buffer.
  for (int k = 1; k < n; ++k) w.waitRank((r + k) % n, reduced, wc);
  CmaReads gatherReads(w);
  allButPiece(at(r), len(r), count * elemSize, grain, ways, [&](size_t b, size_t e) {
    for (int q = 0; q < n; ++q) {
      const size_t lo = std::max(b, at(q)), hi = std::min(e, at(q) + len(q));
      if (lo < hi && !gatherReads.read(q, theirs[q] + lo, data + lo, hi - lo)) return;
    }
  });
  gatherReads.throwIfFailed(wc);
  // Others may still be reading this rank's buffer: it is the caller's again only when
  // every rank is done.
  w.post();
  w.waitAll(w.posted(), wc);
  w.releaseHalf(h);
}

void shmBroadcast(HostWindow& w, const WaitContext& wc, char* data, size_t bytes, int root) {
  const int r = w.rank();
  const size_t per = w.halfBytes();
  for (size_t off = 0; off == 0 || off < bytes; off += per) {
    const size_t len = std::min(per, bytes - off);
    const int h = w.acquireHalf(wc);
    if (off == 0) announce(w, h, kBroadcast, bytes, root);
    if (r == root) std::memcpy(w.half(r, h), data + off, len);
    w.post();
    if (r != root) {
      w.waitRank(root, w.posted(), wc);
      if (off == 0) verify(w, h, root);
      std::memcpy(data + off, w.half(root, h), len);
    } else if (off == 0) {
      checkArrived(w, h);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmReduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
               size_t count, size_t elemSize, kernels::ReduceFn reduce, int root,
               const kernels::Load& load) {
  const int n = w.size(), r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first == 0 || first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const int h = w.acquireHalf(wc);
    if (first == 0) announce(w, h, kReduce, count * elemSize, root);
    load(w.half(r, h), input + first * elemSize, cnt * elemSize);
    w.post();
    w.waitAll(w.posted(), wc);
    if (first == 0) verify(w, h);
    const size_t off = pieceBegin(cnt, n, r) * elemSize;
    const size_t mine = pieceCount(cnt, n, r);
    const size_t block = std::max<size_t>(1, kReduceBlockBytes / elemSize);
    for (size_t e = 0; e < mine; e += block) {  // a block at a time, in L1 across the slots
      const size_t b = std::min(block, mine - e);
      const size_t o = off + e * elemSize;
      for (int q = 0; q < n; ++q) {
        if (q != r) reduce(w.half(r, h) + o, w.half(q, h) + o, b);
      }
      load.finish(w.half(r, h) + o, b * elemSize);
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

void shmDirectReduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
                     size_t count, size_t elemSize, kernels::ReduceFn reduce, int root,
                     const kernels::Load& load) {
  const int r = w.rank();
  const size_t per = chunkElems(w, elemSize);
  for (size_t first = 0; first == 0 || first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const char* src = input + first * elemSize;
    const int h = w.acquireHalf(wc);
    if (first == 0) announce(w, h, kDirectReduce, count * elemSize, root);
    if (r != root) {
      // Nothing to wait for: the root reads the slot, and this half is reused only once
      // every rank has released it.
      load(w.half(r, h), src, cnt * elemSize);
      w.post();
      if (first == 0) checkArrived(w, h, root);
    } else {
      w.post();
      const uint64_t copied = w.posted();
      reduceAsReady(w, wc, h, copied, first == 0, src, output + first * elemSize,
                    cnt * elemSize, elemSize, reduce, load,
                    [&](int q) { return w.half(q, h); }, nullptr);
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
  for (size_t off = 0; off == 0 || off < bytes; off += per) {
    const size_t len = std::min(per, bytes - off);
    const int h = w.acquireHalf(wc);
    if (off == 0) announce(w, h, kAllgather, bytes);
    std::memcpy(w.half(r, h), mine + off, len);
    w.post();
    const uint64_t copied = w.posted();
    for (int k = 1; k < n; ++k) {  // each peer as soon as it is ready
      const int q = (r + k) % n;
      w.waitRank(q, copied, wc);
      if (off == 0) verify(w, h, q);
      std::memcpy(blocks[q].data + off, w.half(q, h), len);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmReduceScatter(HostWindow& w, const WaitContext& wc, const std::vector<Block>& inputs,
                      char* output, size_t elemSize, kernels::ReduceFn reduce,
                      const kernels::Load& load) {
  const int n = w.size(), r = w.rank();
  const size_t count = inputs[r].bytes / elemSize;
  // Each chunk carries the same range of all N blocks.
  const size_t per = std::max<size_t>(1, w.halfBytes() / n / elemSize);
  for (size_t first = 0; first == 0 || first < count; first += per) {
    const size_t cnt = std::min(per, count - first);
    const size_t len = cnt * elemSize;
    const int h = w.acquireHalf(wc);
    if (first == 0) announce(w, h, kReduceScatter, count * elemSize);
    // Only the blocks others reduce go into the slot.
    for (int i = 0; i < n; ++i) {
      if (i != r) load(w.half(r, h) + i * len, inputs[i].data + first * elemSize, len);
    }
    w.post();
    // The output may be this rank's own input block (in place): start from it.
    const uint64_t copied = w.posted();
    reduceAsReady(w, wc, h, copied, first == 0, inputs[r].data + first * elemSize,
                  output + first * elemSize, len, elemSize, reduce, load,
                  [&](int q) { return w.half(q, h) + r * len; }, nullptr);
    w.post();
    w.releaseHalf(h);
  }
}

void shmAlltoall(HostWindow& w, const WaitContext& wc, const std::vector<Block>& sends,
                 const std::vector<Block>& recvs) {
  const int n = w.size(), r = w.rank();
  // Splits may be uneven and are known only to their sender: first every rank publishes
  // its send sizes, so all agree on how many rounds the largest block needs.
  uint64_t largest = 0;
  {
    const int h = w.acquireHalf(wc);
    announce(w, h, kAlltoall, 0);
    auto* mine = reinterpret_cast<uint64_t*>(w.half(r, h));
    for (int q = 0; q < n; ++q) mine[q] = sends[q].bytes;
    w.post();
    w.waitAll(w.posted(), wc);
    verify(w, h);
    for (int q = 0; q < n; ++q) {
      const auto* theirs = reinterpret_cast<const uint64_t*>(w.half(q, h));
      for (int p = 0; p < n; ++p) largest = std::max<uint64_t>(largest, theirs[p]);
      if (theirs[r] != recvs[q].bytes) {
        throw std::runtime_error("rank " + std::to_string(q) + " sends " +
                                 std::to_string(theirs[r]) + " bytes to rank " +
                                 std::to_string(r) + ", which expects " +
                                 std::to_string(recvs[q].bytes) +
                                 ": the ranks' split sizes do not match");
      }
    }
    w.post();
    w.releaseHalf(h);
  }
  if (sends[r].bytes > 0 && sends[r].data != recvs[r].data) {
    std::memmove(recvs[r].data, sends[r].data, sends[r].bytes);
  }
  // Each round moves up to `per` bytes of every (sender, receiver) block.
  const size_t per = std::max<size_t>(64, w.halfBytes() / n / 64 * 64);
  for (uint64_t off = 0; off < largest; off += per) {
    const int h = w.acquireHalf(wc);
    for (int q = 0; q < n; ++q) {
      if (q == r || sends[q].bytes <= off) continue;
      std::memcpy(w.half(r, h) + q * per, sends[q].data + off,
                  std::min<size_t>(per, sends[q].bytes - off));
    }
    w.post();
    w.waitAll(w.posted(), wc);
    for (int q = 0; q < n; ++q) {
      if (q == r || recvs[q].bytes <= off) continue;
      std::memcpy(recvs[q].data + off, w.half(q, h) + r * per,
                  std::min<size_t>(per, recvs[q].bytes - off));
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmGather(HostWindow& w, const WaitContext& wc, const Block& mine,
               const std::vector<Block>& rootBlocks, int root) {
  const int n = w.size(), r = w.rank();
  const size_t per = w.halfBytes();
  if (r == root && mine.bytes > 0 && rootBlocks[r].data != mine.data) {
    std::memmove(rootBlocks[r].data, mine.data, mine.bytes);
  }
  for (size_t off = 0; off == 0 || off < mine.bytes; off += per) {
    const size_t len = std::min(per, mine.bytes - off);
    const int h = w.acquireHalf(wc);
    if (off == 0) announce(w, h, kGather, mine.bytes, root);
    if (r != root) std::memcpy(w.half(r, h), mine.data + off, len);
    w.post();
    if (r == root) {
      w.waitAll(w.posted(), wc);
      if (off == 0) verify(w, h);
      for (int q = 0; q < n; ++q) {
        if (q != r) std::memcpy(rootBlocks[q].data + off, w.half(q, h), len);
      }
    } else if (off == 0) {
      checkArrived(w, h, root);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmScatter(HostWindow& w, const WaitContext& wc, const std::vector<Block>& rootBlocks,
                const Block& mine, int root) {
  const int n = w.size(), r = w.rank();
  const size_t per = std::max<size_t>(64, w.halfBytes() / n / 64 * 64);
  if (r == root && mine.bytes > 0 && rootBlocks[r].data != mine.data) {
    std::memmove(mine.data, rootBlocks[r].data, mine.bytes);
  }
  for (size_t off = 0; off == 0 || off < mine.bytes; off += per) {
    const size_t len = std::min(per, mine.bytes - off);
    const int h = w.acquireHalf(wc);
    if (off == 0) announce(w, h, kScatter, mine.bytes, root);
    if (r == root) {
      for (int q = 0; q < n; ++q) {
        if (q != r) std::memcpy(w.half(r, h) + q * per, rootBlocks[q].data + off, len);
      }
    }
    w.post();
    if (r != root) {
      w.waitRank(root, w.posted(), wc);
      if (off == 0) verify(w, h, root);
      std::memcpy(mine.data + off, w.half(root, h) + r * per, len);
    } else if (off == 0) {
      checkArrived(w, h);
    }
    w.post();
    w.releaseHalf(h);
  }
}

void shmBarrier(HostWindow& w, const WaitContext& wc) {
  const int h = w.acquireHalf(wc);
  announce(w, h, kBarrier, 0);
  w.post();
  w.waitAll(w.posted(), wc);
  verify(w, h);
  // Done reading the others' op info: only now may they reuse this half.
  w.post();
  w.releaseHalf(h);
}

Cost shmAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {3 * chunks(bytes, halfBytes()), double(2 * n - 1) / n * bytes,
          double(n - 1) / n * bytes};
}

int shmAllreduceWays(double bytes, int n, int threads) {
  return passWays(static_cast<size_t>(std::min(bytes, halfBytes()) / std::max(n, 1)), threads);
}

Cost shmDirectAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), 2 * bytes, (n - 1) * bytes};
}

Cost cmaAllreduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {3, 2.0 * (n - 1) / n * bytes, double(n - 1) / n * bytes};
}

int cmaAllreduceWays(double bytes, int n, int threads) {
  return passWays(static_cast<size_t>(bytes / std::max(n, 1)), threads);
}

Cost shmBroadcastCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), bytes, 0};
}

Cost shmReduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {3 * chunks(bytes, halfBytes()), 2 * bytes, double(n - 1) / n * bytes};
}

Cost shmDirectReduceCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), bytes, (n - 1) * bytes};
}

Cost shmAllgatherCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes / n, halfBytes()), double(n + 1) / n * bytes, 0};
}

Cost shmReduceScatterCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes, halfBytes()), double(n + 1) / n * bytes, double(n - 1) / n * bytes};
}

Cost shmAlltoallCost(double bytes, int n) {
  if (n == 1) return {};
  const double per = std::max(64.0, halfBytes() / n);
  return {1 + chunks(bytes / n / n, per), 2.0 * (n - 1) / n * bytes, 0};
}

Cost shmGatherScatterCost(double bytes, int n) {
  if (n == 1) return {};
  return {chunks(bytes / n, halfBytes() / n), 2.0 * (n - 1) / n * bytes, 0};
}

Cost shmBarrierCost(double /*bytes*/, int n) {
  return {n == 1 ? 0.0 : 1.0, 0, 0};
}

} // namespace algorithms
} // namespace tdx
