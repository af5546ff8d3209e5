// Collective algorithms over a Channel. Each is documented in its own file with its
// phases, steps and bytes on the wire; docs/ALGORITHMS.md is the index.
#pragma once

#include <vector>

#include "algorithms/channel.h"
#include "kernels/reduce.h"

namespace tdx {
namespace algorithms {

// allreduce, in place on `data` (count elements of elemSize bytes).
void ringAllreduce(Channel& ch, void* data, size_t count, size_t elemSize,
                   kernels::ReduceFn reduce);

// broadcast from `root`, in place.
void treeBroadcast(Channel& ch, void* data, size_t bytes, int root);

// reduce to `root`: `input` is left untouched, `output` (root only) gets the result.
void treeReduce(Channel& ch, const void* input, void* output, size_t count, size_t elemSize,
                kernels::ReduceFn reduce, int root);

// allgather: blocks[i] receives rank i's contribution; blocks[rank] must already hold
// this rank's data. Blocks may differ in size.
void ringAllgather(Channel& ch, const std::vector<Block>& blocks);

// reduce-scatter: inputs[i] is this rank's contribution to rank i's result, all of
// `counts[i]` elements; `output` receives the reduction of every rank's inputs[rank].
void ringReduceScatter(Channel& ch, const std::vector<Block>& inputs, void* output,
                       size_t elemSize, kernels::ReduceFn reduce);

// all-to-all: sends[i] goes to rank i, recvs[i] comes from rank i.
void pairwiseAlltoall(Channel& ch, const std::vector<Block>& sends,
                      const std::vector<Block>& recvs);

// gather to root / scatter from root (blocks indexed by rank, meaningful on the root).
void directGather(Channel& ch, const Block& mine, const std::vector<Block>& rootBlocks,
                  int root);
void directScatter(Channel& ch, const std::vector<Block>& rootBlocks, const Block& mine,
                   int root);

// barrier: no rank leaves before every rank has entered.
void disseminationBarrier(Channel& ch);

} // namespace algorithms
} // namespace tdx
