// The plan builders, one per file, each opening with its phases, steps, bytes on the wire
// and when it wins; docs/ALGORITHMS.md is the index. Every builder returns this rank's
// plan (plan.h); every cost function the α-β-γ terms for `bytes` at world size `n`.
//
// Sizes in costs follow nccl-tests: all_reduce, broadcast, reduce: the buffer;
// all_gather: the whole output; reduce_scatter: the whole input; all_to_all: all blocks.
#pragma once

#include <vector>

#include "algorithms/channel.h"
#include "algorithms/plan.h"

namespace tdx {
namespace algorithms {

// all_reduce on Data (count elements).
Plan ringAllreducePlan(const PlanArgs& a);
Cost ringAllreduceCost(double bytes, int n);
Plan rhdAllreducePlan(const PlanArgs& a);
Cost rhdAllreduceCost(double bytes, int n);
Plan directAllreducePlan(const PlanArgs& a);
Cost directAllreduceCost(double bytes, int n);

// broadcast of Data (count bytes, elemSize 1) from root.
Plan treeBroadcastPlan(const PlanArgs& a);
Cost treeBroadcastCost(double bytes, int n);
Plan chainBroadcastPlan(const PlanArgs& a);
Cost chainBroadcastCost(double bytes, int n);
// The chunks the chain cuts a broadcast of `bytes` into by default.
size_t chainBroadcastChunks(size_t bytes);

// reduce: Send[0] is this rank's input (never written), Data the root's output; other
// ranks' Data is not touched.
Plan treeReducePlan(const PlanArgs& a);
Cost treeReduceCost(double bytes, int n);

// all_gather: Recv[i] receives rank i's block; Recv[rank] already holds this rank's.
Plan ringAllgatherPlan(const PlanArgs& a);
Cost ringAllgatherCost(double bytes, int n);
Plan rdAllgatherPlan(const PlanArgs& a);  // power-of-two worlds
Cost rdAllgatherCost(double bytes, int n);

// reduce_scatter: Send[i] is this rank's contribution to rank i (never written), Recv[0]
// the result (may alias Send[rank]). All blocks have the same size.
Plan ringReduceScatterPlan(const PlanArgs& a);
Cost ringReduceScatterCost(double bytes, int n);
Plan rhReduceScatterPlan(const PlanArgs& a);  // power-of-two worlds
Cost rhReduceScatterCost(double bytes, int n);

// all_to_all: Send[i] goes to rank i, Recv[i] comes from rank i (any sizes).
Plan pairwiseAlltoallPlan(const PlanArgs& a);
Cost pairwiseAlltoallCost(double bytes, int n);

// barrier.
Plan disseminationBarrierPlan(const PlanArgs& a);
Cost disseminationBarrierCost(double bytes, int n);

// gather to root (Send[0] mine, Recv[i] the root's blocks) / scatter from root (Send[i]
// the root's blocks, Recv[0] mine).
Plan directGatherPlan(const PlanArgs& a);
Plan directScatterPlan(const PlanArgs& a);
Cost directGatherScatterCost(double bytes, int n);

// all_gather of blocks over a ring, for callers outside the registry (fingerprint
// exchange, CUDA handle exchange): blocks[rank] must hold this rank's data.
void ringAllgather(Channel& ch, const std::vector<Block>& blocks);

// Helpers of the builders.
int ceilLog2(int n);
bool isPowerOfTwo(int n);

} // namespace algorithms
} // namespace tdx
