// Pipeline schedules as data: for each stage, the list of actions it runs, in order.
//
// A training step splits its batch into M microbatches that flow through S stages.
// Each stage's list holds, per microbatch, its forward (F) and backward (B) and the
// messages around them: a stage other than the first receives its input activation
// before F (RecvAct) and a stage other than the last sends its output after F (SendAct);
// a stage other than the last receives the gradient of its output before B (RecvGrad)
// and a stage other than the first sends the gradient of its input after B (SendGrad).
//
//   GPipe: every forward, then every backward. Simple, but each stage keeps the
//     activations of all M microbatches until their backward.
//   1F1B:  stage s runs min(S - s - 1, M) forwards to fill the pipeline, then alternates
//     one forward and one backward, then drains the remaining backwards. The same bubble
//     as GPipe, with at most S - s microbatches' activations kept at stage s.
//
// validate() runs a schedule on a model of the executor: sends never block (the executor
// posts them asynchronously) and a receive waits for its matching send. It checks that
// every message has exactly one matching receive, in order, that each stage runs F and
// then B once per microbatch with their inputs ready, and that the stages cannot wait on
// one another forever; its errors name the stage and the step and print the grid. On
// success it gives each action a time slot (F one unit, B two) from which `grid()` draws
// the timeline and `peakInFlight()` the activations each stage keeps.
//
// No torch, no communication: pure data, tested exhaustively in one process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tdx::parallel {

enum class PipeVerb : int8_t { Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad };

struct PipeAction {
  PipeVerb verb;
  int64_t microbatch;
};

const char* pipeVerbName(PipeVerb verb);  // "F", "B", "SA", "RA", "SG", "RG"

class PipelineSchedule {
 public:
  // Throws std::invalid_argument naming the stage, the step and the problem, with the
  // grid of what could run (see validate()).
  PipelineSchedule(std::vector<std::vector<PipeAction>> actions, int64_t microbatches);

  static PipelineSchedule gpipe(int64_t stages, int64_t microbatches);
  static PipelineSchedule oneFOneB(int64_t stages, int64_t microbatches);

  int64_t stages() const { return static_cast<int64_t>(actions_.size()); }
  int64_t microbatches() const { return microbatches_; }
  const std::vector<PipeAction>& actions(int64_t stage) const;
  // The largest number of microbatches whose forward has run and whose backward has not,
  // at each stage: the activations it keeps.
  const std::vector<int64_t>& peakInFlight() const { return peak_; }
  // Time units from the first forward to the last backward (F one unit, B two).
  int64_t makespan() const { return makespan_; }
  // Share of the stages' time spent idle: 1 - busy / (stages * makespan).
  double bubble() const;
  // One row per stage, one column per time unit: F3 is microbatch 3's forward, B3 (two
  // units) its backward, dots idle.
  std::string grid() const;

 private:
  void validate();

  std::vector<std::vector<PipeAction>> actions_;
  int64_t microbatches_;
  std::vector<std::vector<int64_t>> start_;  // per stage and action: its first time unit
  std::vector<int64_t> peak_;
  int64_t makespan_ = 0;
};

} // namespace tdx::parallel
