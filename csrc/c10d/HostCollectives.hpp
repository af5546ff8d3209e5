// Host-memory collectives of a group: pick the algorithm (registry + cost model, or an
// override) and run it, as a plan over the group's channel or through the group's
// shared-memory window. Buffers are contiguous host memory (Collectives.cpp stages
// tensors into them); conventions per collective as in algorithms/collectives.h.
#pragma once

#include <chrono>
#include <vector>

#include "algorithms/channel.h"
#include "c10d/GroupChannel.hpp"
#include "kernels/reduce.h"

namespace tdx {

class ProcessGroupTDX;

namespace host {

using algorithms::Block;

// The reductions take this rank's input through `load`, which scales it on the way for
// PREMUL_SUM and float16 AVG (inputs themselves are never modified unless in place), and
// finish the result through it (AVG's division), once.
// `input` may be `output` (in place); otherwise the two must not overlap.
void allreduce(ProcessGroupTDX& pg, GroupChannel& ch, const char* input, char* output,
               size_t count, size_t elemSize, kernels::ReduceFn reduce,
               const kernels::Load& load);
void broadcast(ProcessGroupTDX& pg, GroupChannel& ch, char* data, size_t bytes, int root);
// `output` (root only) receives the result; the root may pass its input as `output`.
// Other ranks' `input` is never written.
void reduce(ProcessGroupTDX& pg, GroupChannel& ch, const char* input, char* output, size_t count,
            size_t elemSize, kernels::ReduceFn reduce, int root, const kernels::Load& load);
// blocks[rank] must already hold this rank's data.
void allgather(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& blocks);
void reduceScatter(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& inputs,
                   char* output, size_t elemSize, kernels::ReduceFn reduce,
                   const kernels::Load& load);
void alltoall(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& sends,
              const std::vector<Block>& recvs);
void barrier(ProcessGroupTDX& pg, GroupChannel& ch);
// torch's monitored_barrier: every rank reports to rank 0, which names the ranks that did
// not report by the op's deadline (`timeout`, for the message) or were lost, the first of
// them or, with `waitAll`, all of them, and releases the others only when all reported.
void monitoredBarrier(GroupChannel& ch, bool waitAll, std::chrono::milliseconds timeout);
// rootBlocks: the root's gather/scatter list (empty elsewhere).
void gather(ProcessGroupTDX& pg, GroupChannel& ch, const Block& mine,
            const std::vector<Block>& rootBlocks, int root);
void scatter(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<Block>& rootBlocks,
             const Block& mine, int root);

} // namespace host
} // namespace tdx
