#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace tdx::parallel {

namespace {

constexpr int64_t kForwardUnits = 1;
constexpr int64_t kBackwardUnits = 2;  // a backward computes two gradients per layer

int64_t units(PipeVerb verb) {
  if (verb == PipeVerb::Forward) return kForwardUnits;
  if (verb == PipeVerb::Backward) return kBackwardUnits;
  return 0;
}

std::string actionText(const PipeAction& a) {
  return std::string(pipeVerbName(a.verb)) + std::to_string(a.microbatch);
}

// One stage's list with its compute and messages around it, as GPipe and 1F1B place them.
void addForward(std::vector<PipeAction>& list, int64_t stage, int64_t stages, int64_t mb) {
  if (stage > 0) list.push_back({PipeVerb::RecvAct, mb});
  list.push_back({PipeVerb::Forward, mb});
  if (stage < stages - 1) list.push_back({PipeVerb::SendAct, mb});
}

void addBackward(std::vector<PipeAction>& list, int64_t stage, int64_t stages, int64_t mb) {
  if (stage < stages - 1) list.push_back({PipeVerb::RecvGrad, mb});
  list.push_back({PipeVerb::Backward, mb});
  if (stage > 0) list.push_back({PipeVerb::SendGrad, mb});
}

void checkShape(int64_t stages, int64_t microbatches) {
  if (stages < 1) {
    throw std::invalid_argument("a pipeline needs at least 1 stage, not " +
                                std::to_string(stages));
  }
  if (microbatches < 1) {
    throw std::invalid_argument("a pipeline needs at least 1 microbatch, not " +
                                std::to_string(microbatches));
  }
}

} // namespace

const char* pipeVerbName(PipeVerb verb) {
  switch (verb) {
    case PipeVerb::Forward: return "F";
    case PipeVerb::Backward: return "B";
    case PipeVerb::SendAct: return "SA";
    case PipeVerb::RecvAct: return "RA";
    case PipeVerb::SendGrad: return "SG";
    case PipeVerb::RecvGrad: return "RG";
  }
  return "?";
}

PipelineSchedule::PipelineSchedule(std::vector<std::vector<PipeAction>> actions,
                                   int64_t microbatches)
    : actions_(std::move(actions)), microbatches_(microbatches) {
  checkShape(stages(), microbatches);
  validate();
}

PipelineSchedule PipelineSchedule::gpipe(int64_t stages, int64_t microbatches) {
  checkShape(stages, microbatches);
  std::vector<std::vector<PipeAction>> lists(stages);
  for (int64_t s = 0; s < stages; ++s) {
    for (int64_t mb = 0; mb < microbatches; ++mb) addForward(lists[s], s, stages, mb);
    for (int64_t mb = 0; mb < microbatches; ++mb) addBackward(lists[s], s, stages, mb);
  }
  return PipelineSchedule(std::move(lists), microbatches);
}

PipelineSchedule PipelineSchedule::oneFOneB(int64_t stages, int64_t microbatches) {
  checkShape(stages, microbatches);
  std::vector<std::vector<PipeAction>> lists(stages);
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t warmup = std::min(stages - s - 1, microbatches);
    for (int64_t mb = 0; mb < warmup; ++mb) addForward(lists[s], s, stages, mb);
    for (int64_t mb = warmup; mb < microbatches; ++mb) {
      addForward(lists[s], s, stages, mb);
      addBackward(lists[s], s, stages, mb - warmup);
    }
    for (int64_t mb = microbatches - warmup; mb < microbatches; ++mb) {
      addBackward(lists[s], s, stages, mb);
    }
  }
  return PipelineSchedule(std::move(lists), microbatches);
}

const std::vector<PipeAction>& PipelineSchedule::actions(int64_t stage) const {
  if (stage < 0 || stage >= stages()) {
    throw std::out_of_range("stage " + std::to_string(stage) + " is not in a pipeline of " +
                            std::to_string(stages()));
  }
  return actions_[stage];
}

void PipelineSchedule::validate() {
  const int64_t S = stages();
  const int64_t M = microbatches_;
  start_.assign(S, {});
  for (int64_t s = 0; s < S; ++s) start_[s].assign(actions_[s].size(), -1);
  peak_.assign(S, 0);

  // Per stage: where it is in its list, its clock, and what it has done per microbatch.
  std::vector<size_t> next(S, 0);
  std::vector<int64_t> clock(S, 0), inFlight(S, 0);
  enum Done { kF, kB, kSA, kRA, kSG, kRG, kKinds };
  std::vector<std::vector<std::vector<bool>>> done(
      S, std::vector<std::vector<bool>>(kKinds, std::vector<bool>(M, false)));
  // Messages sent and not yet received, per channel: (microbatch, time sent). Channel
  // (s, true) carries activations from s to s + 1, (s, false) gradients from s to s - 1.
  std::map<std::pair<int64_t, bool>, std::deque<std::pair<int64_t, int64_t>>> wire;

  auto fail = [&](int64_t s, const std::string& why) {
    std::ostringstream out;
    out << "pipeline schedule (" << S << " stages, " << M << " microbatches): stage " << s;
    if (next[s] < actions_[s].size()) {
      out << ", step " << next[s] << " (" << actionText(actions_[s][next[s]]) << ")";
    }
    out << ": " << why << "\nwhat ran before it:\n" << grid();
    throw std::invalid_argument(out.str());
  };

  // Why stage s cannot run its next action now; empty when it can. Throws for an action
  // that can never be right.
  auto blocker = [&](int64_t s) -> std::string {
    const PipeAction& a = actions_[s][next[s]];
    const int64_t mb = a.microbatch;
    if (mb < 0 || mb >= M) fail(s, "microbatch " + std::to_string(mb) + " is not in [0, " +
                                   std::to_string(M) + ")");
    const auto& d = done[s];
    const std::string of = "microbatch " + std::to_string(mb) + "'s ";
    switch (a.verb) {
      case PipeVerb::Forward:
        if (d[kF][mb]) fail(s, of + "forward runs twice");
        if (s > 0 && !d[kRA][mb]) fail(s, of + "activation has not been received");
        return "";
      case PipeVerb::Backward:
        if (d[kB][mb]) fail(s, of + "backward runs twice");
        if (!d[kF][mb]) fail(s, of + "forward has not run on this stage");
        if (s < S - 1 && !d[kRG][mb]) fail(s, of + "output gradient has not been received");
        return "";
      case PipeVerb::SendAct:
        if (s == S - 1) fail(s, "the last stage has no next stage to send activations to");
        if (d[kSA][mb]) fail(s, of + "activation is sent twice");
        if (!d[kF][mb]) fail(s, of + "activation is sent before its forward");
        return "";
      case PipeVerb::SendGrad:
        if (s == 0) fail(s, "the first stage has no previous stage to send gradients to");
        if (d[kSG][mb]) fail(s, of + "input gradient is sent twice");
        if (!d[kB][mb]) fail(s, of + "input gradient is sent before its backward");
        return "";
      case PipeVerb::RecvAct:
      case PipeVerb::RecvGrad: {
        const bool act = a.verb == PipeVerb::RecvAct;
        if (act && s == 0) fail(s, "the first stage has no previous stage to receive from");
        if (!act && s == S - 1) fail(s, "the last stage has no next stage to receive from");
        if (d[act ? kRA : kRG][mb]) fail(s, of + (act ? "activation" : "gradient") +
                                                " is received twice");
        const int64_t from = act ? s - 1 : s + 1;
        const auto& q = wire[{from, act}];
        if (q.empty()) {
          return "waits for stage " + std::to_string(from) + " to send " + of +
                 (act ? "activation" : "output gradient");
        }
        if (q.front().first != mb) {
          fail(s, "receives " + of + (act ? "activation" : "gradient") + ", but stage " +
                      std::to_string(from) + " sent microbatch " +
                      std::to_string(q.front().first) + "'s first (messages between two "
                      "stages arrive in the order they were sent)");
        }
        return "";
      }
    }
    return "";
  };

  auto run = [&](int64_t s) {
    const PipeAction& a = actions_[s][next[s]];
    const int64_t mb = a.microbatch;
    auto& d = done[s];
    switch (a.verb) {
      case PipeVerb::Forward:
        d[kF][mb] = true;
        peak_[s] = std::max(peak_[s], ++inFlight[s]);
        break;
      case PipeVerb::Backward:
        d[kB][mb] = true;
        --inFlight[s];
        break;
      case PipeVerb::SendAct:
        d[kSA][mb] = true;
        wire[{s, true}].push_back({mb, clock[s]});
        break;
      case PipeVerb::SendGrad:
        d[kSG][mb] = true;
        wire[{s, false}].push_back({mb, clock[s]});
        break;
      case PipeVerb::RecvAct:
      case PipeVerb::RecvGrad: {
        const bool act = a.verb == PipeVerb::RecvAct;
        auto& q = wire[{act ? s - 1 : s + 1, act}];
        clock[s] = std::max(clock[s], q.front().second);
        q.pop_front();
        d[act ? kRA : kRG][mb] = true;
        break;
      }
    }
    start_[s][next[s]] = clock[s];
    clock[s] += units(a.verb);
    ++next[s];
  };

  // Run every stage as far as it can go, again and again, until all are done or none
  // can move: then each is waiting for a message that will never come.
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t s = 0; s < S; ++s) {
      while (next[s] < actions_[s].size() && blocker(s).empty()) {
        run(s);
        moved = true;
      }
    }
  }
  std::string stuck;
  int64_t firstStuck = -1;
  for (int64_t s = 0; s < S; ++s) {
    if (next[s] < actions_[s].size()) {
      stuck += "\n  stage " + std::to_string(s) + ", step " + std::to_string(next[s]) + " (" +
               actionText(actions_[s][next[s]]) + ") " + blocker(s);
      if (firstStuck < 0) firstStuck = s;
    }
  }
  if (firstStuck >= 0) fail(firstStuck, "the stages wait for one another forever:" + stuck);

  // Everything ran: each stage must have done its whole part for every microbatch.
  const char* names[kKinds] = {"forward", "backward", "activation send", "activation receive",
                               "gradient send", "gradient receive"};
  for (int64_t s = 0; s < S; ++s) {
    for (int k = 0; k < kKinds; ++k) {
      const bool needed = (k == kF || k == kB) || (k == kSA && s < S - 1) ||
                          (k == kRG && s < S - 1) || (k == kRA && s > 0) ||
                          (k == kSG && s > 0);
      if (!needed) continue;
      for (int64_t mb = 0; mb < M; ++mb) {
        if (!done[s][k][mb]) {
          fail(s, "microbatch " + std::to_string(mb) + "'s " + names[k] + " never runs");
        }
      }
    }
    makespan_ = std::max(makespan_, clock[s]);
  }
}

double PipelineSchedule::bubble() const {
  const int64_t busy = stages() * microbatches_ * (kForwardUnits + kBackwardUnits);
  return makespan_ == 0 ? 0.0
                        : 1.0 - static_cast<double>(busy) / (stages() * makespan_);
}

std::string PipelineSchedule::grid() const {
  int64_t width = 2 + static_cast<int64_t>(std::to_string(std::max<int64_t>(
                          microbatches_ - 1, 0)).size());
  int64_t end = 0;
  for (int64_t s = 0; s < stages(); ++s) {
    for (size_t i = 0; i < actions_[s].size(); ++i) {
      if (start_.size() == actions_.size() && start_[s].size() > i && start_[s][i] >= 0) {
        end = std::max(end, start_[s][i] + units(actions_[s][i].verb));
      }
    }
  }
  std::ostringstream out;
  for (int64_t s = 0; s < stages(); ++s) {
    std::vector<std::string> cells(end, ".");
    for (size_t i = 0; i < actions_[s].size(); ++i) {
      if (start_.size() != actions_.size() || start_[s].size() <= i || start_[s][i] < 0) {
        continue;
      }
      const auto& a = actions_[s][i];
      for (int64_t u = 0; u < units(a.verb); ++u) cells[start_[s][i] + u] = actionText(a);
    }
    out << "stage " << s << " |";
    for (const auto& c : cells) out << std::string(width - c.size(), ' ') << c;
    out << "\n";
  }
  return out.str();
}

} // namespace tdx::parallel
