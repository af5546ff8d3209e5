#include "c10d/HostCollectives.hpp"

#include <cstring>

#include "algorithms/executor.h"
#include "algorithms/shm_collectives.h"
#include "c10d/ProcessGroupTDX.hpp"

namespace tdx {
namespace host {

using algorithms::Buffers;
using algorithms::Collective;
using algorithms::PlanArgs;

namespace {

PlanArgs argsFor(const GroupChannel& ch) {
  PlanArgs a;
  a.rank = ch.rank();
  a.size = ch.size();
  return a;
}

void run(GroupChannel& ch, const ProcessGroupTDX::Selected& sel, const PlanArgs& a,
         const Buffers& b, kernels::ReduceFn reduce,
         const kernels::Load& load = kernels::Load{}) {
  algorithms::runPlan(ch, sel.algorithm->plan(a), b, a.elemSize, reduce,
                      algorithms::defaultSegmentBytes(), load);
}

// Counts a shared-memory op's signals as its steps (for the flight recorder), also when
// it fails part way.
class ShmSteps {
 public:
  ShmSteps(GroupChannel& ch, const transport::HostWindow& w) : ch_(ch), w_(w), start_(w.posted()) {}
  ~ShmSteps() {
    ch_.addSteps(static_cast<uint32_t>(w_.posted() - start_));
  }

 private:
  GroupChannel& ch_;
  const transport::HostWindow& w_;
  uint64_t start_;
};

// Runs a shared-memory op. When it fails on this rank (a mismatch only this rank can
// see, a timeout, an abort), the peers waiting for this rank in the window hear of it at
// once instead of waiting out their own timeout.
template <class F>
void onWindow(GroupChannel& ch, transport::HostWindow& w, F&& op) {
  ShmSteps steps(ch, w);
  w.setOpSeq(ch.seq());
  w.setOpDetail(ch.opDetail());
  try {
    op();
  } catch (const std::exception& e) {
    w.publishFailure(e.what());
    throw;
  }
}

size_t totalBytes(const std::vector<Block>& blocks) {
  size_t t = 0;
  for (const auto& b : blocks) t += b.bytes;
  return t;
}

} // namespace

void allreduce(ProcessGroupTDX& pg, GroupChannel& ch, const char* input, char* output,
               size_t count, size_t elemSize, kernels::ReduceFn reduce,
               const kernels::Load& load) {
  auto sel = pg.select(Collective::Allreduce, double(count * elemSize), ch, "all_reduce");
  const bool shm = sel.window && std::strcmp(sel.algorithm->name, "cma") != 0;
  // The shared-memory copies read `input` and write `output` anyway; every other
  // algorithm works in place, on a (scaled) copy.
  if (ch.size() == 1 || !shm) load(output, input, count * elemSize);
  if (ch.size() == 1) return;
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      if (!shm) {
        algorithms::cmaAllreduce(*sel.window, sel.wait, output, count, elemSize, reduce, load);
      } else if (std::strcmp(sel.algorithm->name, "shm_direct") == 0) {
        algorithms::shmDirectAllreduce(*sel.window, sel.wait, input, output, count, elemSize,
                                       reduce, load);
      } else {
        algorithms::shmAllreduce(*sel.window, sel.wait, input, output, count, elemSize, reduce,
                                 load);
      }
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.count = count;
  a.elemSize = elemSize;
  Buffers b;
  b.data = output;
  b.dataBytes = count * elemSize;
  run(ch, sel, a, b, reduce);
  load.finish(output, count * elemSize);
}

void broadcast(ProcessGroupTDX& pg, GroupChannel& ch, char* data, size_t bytes, int root) {
  auto sel = pg.select(Collective::Broadcast, double(bytes), ch, "broadcast");
  if (ch.size() == 1) return;
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmBroadcast(*sel.window, sel.wait, data, bytes, root);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.count = bytes;
  a.root = root;
  Buffers b;
  b.data = data;
  b.dataBytes = bytes;
  ch.setAcknowledgedSends(pg.acknowledgesRootedSends());
  run(ch, sel, a, b, nullptr);
}

void reduce(ProcessGroupTDX& pg, GroupChannel& ch, const char* input, char* output, size_t count,
            size_t elemSize, kernels::ReduceFn fn, int root, const kernels::Load& load) {
  auto sel = pg.select(Collective::Reduce, double(count * elemSize), ch, "reduce");
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      if (std::strcmp(sel.algorithm->name, "shm_direct") == 0) {
        algorithms::shmDirectReduce(*sel.window, sel.wait, input, output, count, elemSize, fn,
                                    root, load);
      } else {
        algorithms::shmReduce(*sel.window, sel.wait, input, output, count, elemSize, fn, root,
                              load);
      }
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.count = count;
  a.elemSize = elemSize;
  a.root = root;
  a.sendBytes = {count * elemSize};
  Buffers b;
  b.data = output;
  b.dataBytes = count * elemSize;
  // The executor scales the input where the plan first reads it (`load`).
  b.send = {Block{const_cast<char*>(input), count * elemSize}};
  ch.setAcknowledgedSends(pg.acknowledgesRootedSends());
  run(ch, sel, a, b, fn, load);
  if (ch.rank() == root) load.finish(output, count * elemSize);
}

void allgather(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& blocks) {
  auto sel = pg.select(Collective::Allgather, double(totalBytes(blocks)), ch, "all_gather");
  if (ch.size() == 1) return;
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmAllgather(*sel.window, sel.wait, blocks[ch.rank()].data, blocks);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  for (const auto& blk : blocks) a.recvBytes.push_back(blk.bytes);
  Buffers b;
  b.recv = blocks;
  run(ch, sel, a, b, nullptr);
}

void reduceScatter(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& inputs,
                   char* output, size_t elemSize, kernels::ReduceFn fn,
                   const kernels::Load& load) {
  auto sel = pg.select(Collective::ReduceScatter, double(totalBytes(inputs)), ch,
                       "reduce_scatter");
  const size_t bytes = inputs[ch.rank()].bytes;
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmReduceScatter(*sel.window, sel.wait, inputs, output, elemSize, fn, load);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.elemSize = elemSize;
  for (const auto& blk : inputs) a.sendBytes.push_back(blk.bytes);
  a.recvBytes = {bytes};
  Buffers b;
  // The blocks (this rank's contribution to each rank), scaled by the executor where the
  // plan first reads them (`load`).
  b.send = inputs;
  b.recv = {Block{output, bytes}};
  run(ch, sel, a, b, fn, load);
  load.finish(output, bytes);
}

void alltoall(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& sends,
              const std::vector<Block>& recvs) {
  // Uneven splits give ranks different totals, and every rank must make the same choice:
  // it is made for an empty message (latency only), which picks shared memory on one
  // host and pairwise exchange across hosts.
  auto sel = pg.select(Collective::Alltoall, 0, ch, "all_to_all");
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmAlltoall(*sel.window, sel.wait, sends, recvs);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  for (const auto& blk : sends) a.sendBytes.push_back(blk.bytes);
  for (const auto& blk : recvs) a.recvBytes.push_back(blk.bytes);
  Buffers b;
  b.send = sends;
  b.recv = recvs;
  run(ch, sel, a, b, nullptr);
}

void barrier(ProcessGroupTDX& pg, GroupChannel& ch) {
  auto sel = pg.select(Collective::Barrier, 0, ch, "barrier");
  if (ch.size() == 1) return;
  if (sel.window) {
    onWindow(ch, *sel.window, [&] { algorithms::shmBarrier(*sel.window, sel.wait); });
    return;
  }
  run(ch, sel, argsFor(ch), Buffers{}, nullptr);
}

void monitoredBarrier(GroupChannel& ch, bool waitAll, std::chrono::milliseconds timeout) {
  ch.setAlgorithm("monitored");  // the flight record's path
  const int n = ch.size(), r = ch.rank();
  if (n == 1) return;
  // Messages of one byte: step 0 reports to rank 0, step 1 is rank 0's release. The
  // buffers live as long as the channel: a late report or release may still land after
  // an error has unwound this frame, before the channel cancels what is posted.
  auto buffers = std::make_shared<std::vector<char>>(n + 1, 0);
  ch.keep(buffers, buffers->size());
  char* token = &buffers->at(n);
  *token = 1;
  char* tokens = buffers->data();
  if (r != 0) {
    // Waits for rank 0 alone: another rank's loss or lateness is rank 0's to report,
    // and this rank says nothing to the group (the op does not tell peers), so rank 0's
    // error is the one every rank ends with when rank 0 fails.
    auto report = ch.isend(0, 0, token, 1);
    auto release = ch.irecv(0, 1, &tokens[0], 1);
    const std::string late =
        "rank " + std::to_string(r) + " reached monitored_barrier, but rank 0 did not " +
        "release it within " + std::to_string(timeout.count()) + " ms and a grace: rank 0 " +
        "has not reached it, or is waiting for a rank that has not. Rank 0's error names " +
        "the ranks that did not arrive";
    ch.wait(report, GroupChannel::Watch{false, late.c_str()});
    ch.wait(release, GroupChannel::Watch{false, late.c_str()});
    return;
  }
  std::vector<transport::RequestPtr> reports(n);
  for (int q = 1; q < n; ++q) reports[q] = ch.irecv(q, 0, &tokens[q], 1);
  // Every report watched at once, so a lost rank is named at once, not after the ranks
  // before it in order have been waited for.
  std::vector<std::string> why(n);
  std::vector<bool> open(n, true);
  open[0] = false;
  for (;;) {
    int first = -1;
    bool failed = false;
    for (int q = 1; q < n; ++q) {
      if (open[q]) {
        if (reports[q]->done()) {
          open[q] = false;
          if (!reports[q]->ok()) {
            why[q] = "its report failed: " + reports[q]->error;
          } else if (reports[q]->receivedBytes != 1) {
            // A 0-byte message of the same step: that rank called barrier here (other
            // collectives carry another kind, found below).
            why[q] = "it called another op (its message had " +
                     std::to_string(reports[q]->receivedBytes) + " bytes, a report has 1)";
          }
        } else if (ch.peerLost(q)) {
          open[q] = false;
          why[q] = "lost (its connection failed)";
        } else if (const char* other = ch.otherOpFrom(q)) {
          // Its message of another collective, which the report cannot take, is here.
          open[q] = false;
          why[q] = std::string("it called ") + other + " here";
        } else if (first < 0) {
          first = q;
        }
      }
      failed = failed || !why[q].empty();
    }
    if (first < 0 || (failed && !waitAll)) break;
    if (ch.abortedFlag().load()) {
      throw std::runtime_error(
          "the process group was shut down (destroyed or aborted) during monitored_barrier");
    }
    if (transport::Clock::now() >= ch.deadline()) {
      for (int q = 1; q < n; ++q) {
        if (open[q]) why[q] = "did not arrive";
      }
      break;
    }
    ch.settle(reports[first], transport::Clock::now() + std::chrono::milliseconds(50));
  }
  std::vector<int> failedRanks, arrived{0};
  std::string detail;
  for (int q = 1; q < n; ++q) {
    if (why[q].empty()) {
      if (!open[q]) arrived.push_back(q);
      continue;
    }
    failedRanks.push_back(q);
    detail += (detail.empty() ? "" : "; ") + std::string("rank ") + std::to_string(q) + ": " +
              why[q];
    if (!waitAll) break;  // fail fast: the first failed rank, as torch documents
  }
  if (!failedRanks.empty()) {
    // torch's wording first (tools look for it), then why and who did arrive.
    std::string text = rankList(failedRanks, "Rank ", "Ranks ") +
                       " failed to pass monitoredBarrier in " +
                       std::to_string(timeout.count()) + " ms (" + detail + ")";
    if (waitAll) text += "; arrived: " + rankList(arrived);
    throw std::runtime_error(text);
  }
  std::vector<transport::RequestPtr> releases;
  for (int q = 1; q < n; ++q) releases.push_back(ch.isend(q, 1, token, 1));
  ch.waitAll(releases);
}

void gather(ProcessGroupTDX& pg, GroupChannel& ch, const Block& mine,
            const std::vector<Block>& rootBlocks, int root) {
  auto sel = pg.select(Collective::Gather, double(mine.bytes) * ch.size(), ch, "gather");
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmGather(*sel.window, sel.wait, mine, rootBlocks, root);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.root = root;
  a.sendBytes = {mine.bytes};
  for (const auto& blk : rootBlocks) a.recvBytes.push_back(blk.bytes);
  Buffers b;
  b.send = {mine};
  b.recv = rootBlocks;
  ch.setAcknowledgedSends(pg.acknowledgesRootedSends());
  run(ch, sel, a, b, nullptr);
}

void scatter(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& rootBlocks,
             const Block& mine, int root) {
  auto sel = pg.select(Collective::Scatter, double(mine.bytes) * ch.size(), ch, "scatter");
  if (sel.window) {
    onWindow(ch, *sel.window, [&] {
      algorithms::shmScatter(*sel.window, sel.wait, rootBlocks, mine, root);
    });
    return;
  }
  PlanArgs a = argsFor(ch);
  a.root = root;
  a.recvBytes = {mine.bytes};
  for (const auto& blk : rootBlocks) a.sendBytes.push_back(blk.bytes);
  Buffers b;
  b.send = rootBlocks;
  b.recv = {mine};
  ch.setAcknowledgedSends(pg.acknowledgesRootedSends());
  run(ch, sel, a, b, nullptr);
}

} // namespace host
} // namespace tdx
