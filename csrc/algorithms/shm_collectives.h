// Collectives through a shared-memory window among the ranks of one host
// (transport/peer_memory/host_window.h): ranks copy chunks into their own slot, signal,
// and read or reduce each other's slots directly, instead of exchanging messages.
// Each function is a whole collective; all ranks of the window call the same one.
// The reductions take this rank's input through a kernels::Load, which scales it on its
// first copy when the op asks for it (PREMUL_SUM, float16 AVG).
//
// The window's slots are split in two halves used alternately, so ranks copy the next
// chunk while slower ranks still read the previous one; a half is reused only once every
// rank has signalled it is done with it.
#pragma once

#include <vector>

#include "algorithms/channel.h"
#include "algorithms/plan.h"
#include "kernels/reduce.h"
#include "transport/peer_memory/host_window.h"

namespace tdx {
namespace algorithms {

using transport::HostWindow;
using transport::WaitContext;

// The reducing ops take a rank's input through `load` (scaled where the op scales) and
// finish each block of the result through it once the block is final (AVG's division),
// so neither costs a pass of its own. cmaAllreduce, which reduces in place in `data`,
// only finishes (its caller has loaded the input).

// Reduce-scatter then all-gather through the window: each rank reduces 1/N of every
// chunk, from the others' slots into its own buffer, and publishes it; 3 signals per
// chunk. For medium and large messages. `input` may be `output` (in place); otherwise
// it is only read, and the copy an out-of-place call would need costs 1/N of it.
void shmAllreduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
                  size_t count, size_t elemSize, kernels::ReduceFn reduce,
                  const kernels::Load& load);
// Every rank reduces every slot itself, in rank order (identical bits everywhere); one
// signal on the critical path per chunk. For small messages. `input` may be `output`.
void shmDirectAllreduce(HostWindow& w, const WaitContext& wc, const char* input,
                        char* output, size_t count, size_t elemSize,
                        kernels::ReduceFn reduce, const kernels::Load& load);
// Ranks read each other's buffers in place (cross-memory attach) instead of copying
// through the window: each reduces its 1/N piece from the others' buffers, then reads
// the others' finished pieces. 3 signals per op, whatever its size, and no copies into
// or out of the window. Needs HostWindow::crossMemory().
void cmaAllreduce(HostWindow& w, const WaitContext& wc, char* data, size_t count,
                  size_t elemSize, kernels::ReduceFn reduce, const kernels::Load& load);
void shmBroadcast(HostWindow& w, const WaitContext& wc, char* data, size_t bytes, int root);
// `output` (root only) receives the result and may be `input`; other ranks' `input` is
// never written.
void shmReduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
               size_t count, size_t elemSize, kernels::ReduceFn reduce, int root,
               const kernels::Load& load);
// The root reduces every rank's slot into its output itself, each as soon as it is
// ready; the other ranks copy in and signal once, and wait for nobody. One signal per
// chunk on the critical path: for small messages, and for hosts with more ranks than
// cores, where each signal every rank must wait for costs a wake-up.
void shmDirectReduce(HostWindow& w, const WaitContext& wc, const char* input, char* output,
                     size_t count, size_t elemSize, kernels::ReduceFn reduce, int root,
                     const kernels::Load& load);
// blocks[i] receives rank i's block (all the same size); `mine` is this rank's input,
// which blocks[rank] must already hold.
void shmAllgather(HostWindow& w, const WaitContext& wc, const char* mine,
                  const std::vector<Block>& blocks);
// inputs[i]: this rank's contribution to rank i (all blocks the same size); output may
// alias inputs[rank].
void shmReduceScatter(HostWindow& w, const WaitContext& wc, const std::vector<Block>& inputs,
                      char* output, size_t elemSize, kernels::ReduceFn reduce,
                      const kernels::Load& load);
// sends[i] goes to rank i, recvs[i] comes from rank i (uneven sizes allowed; the
// ranks' split sizes are checked against each other first).
void shmAlltoall(HostWindow& w, const WaitContext& wc, const std::vector<Block>& sends,
                 const std::vector<Block>& recvs);
// rootBlocks: the root's list (empty elsewhere); blocks all of `mine.bytes`.
void shmGather(HostWindow& w, const WaitContext& wc, const Block& mine,
               const std::vector<Block>& rootBlocks, int root);
void shmScatter(HostWindow& w, const WaitContext& wc, const std::vector<Block>& rootBlocks,
                const Block& mine, int root);
void shmBarrier(HostWindow& w, const WaitContext& wc);

// Cost terms (collectives.h conventions), for windows of the default slot size
// (TDX_SHM_SLOT_BYTES), whose halves set the chunks.
Cost shmAllreduceCost(double bytes, int n);
// How many threads shmAllreduce really splits its reduction over with `threads` per rank:
// a chunk's piece (a window half over n) split as passWays says.
int shmAllreduceWays(double bytes, int n, int threads);
Cost shmDirectAllreduceCost(double bytes, int n);
Cost cmaAllreduceCost(double bytes, int n);
// The same for cmaAllreduce: its reads and reductions of a rank's piece (bytes over n)
// split as passWays says.
int cmaAllreduceWays(double bytes, int n, int threads);
Cost shmBroadcastCost(double bytes, int n);
Cost shmReduceCost(double bytes, int n);
Cost shmDirectReduceCost(double bytes, int n);
Cost shmAllgatherCost(double bytes, int n);
Cost shmReduceScatterCost(double bytes, int n);
Cost shmAlltoallCost(double bytes, int n);
Cost shmGatherScatterCost(double bytes, int n);
Cost shmBarrierCost(double bytes, int n);

} // namespace algorithms
} // namespace tdx
