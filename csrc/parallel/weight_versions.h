// Which version of a stage's weights each microbatch uses when the weights change during
// a pipeline's step (asynchronous pipelines), and which copies of older versions the
// stage must keep for that.
//
// A stage runs its action list (pipeline_schedule.h). Its live weights start at version
// `startVersion` and go up by one at each update:
//
//   PerMicrobatch (PipeDream, weight stashing): an update after every backward, with that
//     microbatch's gradient alone. A microbatch's forward uses the live weights, and its
//     backward the same version, so a stage keeps a copy of each version that microbatches
//     still in flight were run with.
//   DoubleBuffered (PipeDream-2BW): the microbatches come in batches of `updateEvery`, and
//     an update follows the backward that completes a batch, with that batch's summed
//     gradient. Batch b (counted over the whole run: the call's first batch is number
//     startVersion) runs on version max(b - 1, 0): every update applies a gradient that
//     is one update old, so the forwards of batch b need not wait for batch b - 1's
//     backwards. The stage keeps the version before the live one.
//
// The rules a stage's executor follows, which the plan simulates:
//   - a microbatch's forward uses the live weights when they are its version and no
//     update comes before its backward; otherwise a copy of its version ("stashed"),
//     made from the live weights at its forward when no copy exists yet;
//   - in DoubleBuffered mode an update first copies the version it replaces, if no copy
//     exists: the next batch runs on it;
//   - a copy is dropped once no microbatch in flight uses it (in DoubleBuffered mode the
//     version before the live one stays).
//
// No torch, no communication: pure data, tested in one process.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace tdx::parallel {

enum class WeightUpdate : int8_t { PerMicrobatch, DoubleBuffered };

struct WeightPlan {
  std::vector<int64_t> version;      // per microbatch: the version its forward and backward use
  std::vector<bool> stashed;         // per microbatch: it runs on a copy, not the live weights
  std::vector<int64_t> updateAfter;  // per action: the version made right after it, or -1
  int64_t peakCopies = 0;            // the most copies kept at once
  int64_t endVersion = 0;            // the live version after the last action
  int64_t endCopies = 0;             // copies kept after the last action (for the next call)
};

// Throws std::invalid_argument for an updateEvery below 1, a microbatch count it does not
// divide (DoubleBuffered), a negative startVersion, or a forward that needs a version not
// made yet (DoubleBuffered with batches too small for the stage's depth), naming the
// stage, the microbatch and the versions.
WeightPlan planWeights(const std::vector<PipeAction>& actions, int64_t stage,
                       int64_t microbatches, WeightUpdate mode, int64_t updateEvery,
                       int64_t startVersion);

} // namespace tdx::parallel
