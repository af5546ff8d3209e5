// The one executor every plan runs on.
//
// Per step: receives are posted first (so no sender waits on a missing receive), then
// sends. A transfer the receiver reduces (RecvReduce, and the Send marked `segmented`
// that feeds it) is cut into segments of at most `segmentBytes`, all posted at once, so
// the reduction of segment k overlaps the transfer of segment k+1: it lands in a staging
// area and is reduced segment by segment as segments arrive. Every other transfer is one
// message. Local copies and reductions run when the step's transfers are done. Messages
// of one (sender, step) match in posting order, as the transport's tag matching is
// non-overtaking.
#pragma once

#include <vector>

#include "algorithms/channel.h"
#include "algorithms/plan.h"
#include "kernels/reduce.h"

namespace tdx {
namespace algorithms {

struct Buffers {
  char* data = nullptr;
  size_t dataBytes = 0;  // the Data region's size: a plan's spans are checked against it
  std::vector<Block> send;
  std::vector<Block> recv;
};

// Runs `plan` for this rank. `reduce` may be null for plans without reductions. Every
// read of the Send region goes through `load`: a scaling load (PREMUL_SUM, float16 AVG)
// scales this rank's input where a copy or reduction reads it anyway, and into scratch
// only what is sent as it is.
void runPlan(Channel& ch, const Plan& plan, const Buffers& buffers, size_t elemSize,
             kernels::ReduceFn reduce, size_t segmentBytes,
             const kernels::Load& load = kernels::Load{});

// The segment size the executor uses unless told otherwise (TDX_SEGMENT_BYTES).
size_t defaultSegmentBytes();

} // namespace algorithms
} // namespace tdx
