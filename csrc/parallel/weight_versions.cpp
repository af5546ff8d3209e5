#include "parallel/weight_versions.h"

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>

namespace tdx::parallel {

namespace {

std::string where(int64_t stage, int64_t mb) {
  return "stage " + std::to_string(stage) + ", microbatch " + std::to_string(mb);
}

} // namespace

WeightPlan planWeights(const std::vector<PipeAction>& actions, int64_t stage,
                       int64_t microbatches, WeightUpdate mode, int64_t updateEvery,
                       int64_t startVersion) {
  const bool perMb = mode == WeightUpdate::PerMicrobatch;
  if (updateEvery < 1) {
    throw std::invalid_argument("weight updates every " + std::to_string(updateEvery) +
                                " microbatches: at least 1");
  }
  if (!perMb && microbatches % updateEvery != 0) {
    throw std::invalid_argument(
        "2BW updates once per batch of " + std::to_string(updateEvery) + " microbatches, "
        "which does not divide a step's " + std::to_string(microbatches) +
        "; make the microbatches per step a multiple of it");
  }
  if (startVersion < 0) {
    throw std::invalid_argument("a negative start version: " + std::to_string(startVersion));
  }
  const int64_t M = microbatches;
  WeightPlan plan;
  plan.version.assign(M, -1);
  plan.stashed.assign(M, false);
  plan.updateAfter.assign(actions.size(), -1);

  // First pass: versions and update points (they do not depend on the copies).
  int64_t live = startVersion;
  std::vector<int64_t> backsInBatch(M / std::max<int64_t>(updateEvery, 1) + 1, 0);
  std::vector<size_t> forwardAt(M, 0), backwardAt(M, 0);
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    if (a.verb == PipeVerb::Forward) {
      forwardAt[a.microbatch] = i;
      int64_t want = live;
      if (!perMb) {
        const int64_t batch = startVersion + a.microbatch / updateEvery;
        want = std::max<int64_t>(batch - 1, 0);
        if (want > live) {
          throw std::invalid_argument(
              "2BW: " + where(stage, a.microbatch) + " runs its forward on weights version " +
              std::to_string(want) + ", but the stage has made only version " +
              std::to_string(live) + " by then: its batches of " + std::to_string(updateEvery) +
              " microbatches are too small for its depth in the pipeline; use at least as "
              "many microbatches per update as there are stages");
        }
      }
      plan.version[a.microbatch] = want;
    } else if (a.verb == PipeVerb::Backward) {
      backwardAt[a.microbatch] = i;
      bool update = perMb;
      if (!perMb) update = ++backsInBatch[a.microbatch / updateEvery] == updateEvery;
      if (update) plan.updateAfter[i] = ++live;
    }
  }
  plan.endVersion = live;

  // A microbatch runs on the live weights only if they are its version at its forward
  // and no update comes before its backward.
  live = startVersion;
  for (int64_t mb = 0; mb < M; ++mb) {
    bool updated = false;
    for (size_t i = forwardAt[mb]; i < backwardAt[mb]; ++i) updated |= plan.updateAfter[i] >= 0;
    int64_t liveAtForward = startVersion;
    for (size_t i = 0; i < forwardAt[mb]; ++i) {
      if (plan.updateAfter[i] >= 0) liveAtForward = plan.updateAfter[i];
    }
    plan.stashed[mb] = updated || plan.version[mb] != liveAtForward;
  }

  // Second pass: the copies, by the executor's rules.
  std::set<int64_t> copies;
  if (!perMb && startVersion >= 1) copies.insert(startVersion - 1);  // kept by the last call
  std::multiset<int64_t> inFlight;  // versions of stashed microbatches between F and B
  live = startVersion;
  auto dropUnused = [&]() {
    for (auto it = copies.begin(); it != copies.end();) {
      const bool keep = inFlight.count(*it) > 0 || (!perMb && *it == live - 1);
      it = keep ? std::next(it) : copies.erase(it);
    }
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    const int64_t mb = a.microbatch;
    if (a.verb == PipeVerb::Forward && plan.stashed[mb]) {
      const int64_t v = plan.version[mb];
      if (!copies.count(v)) {
        if (v != live) {
          throw std::logic_error("weight plan: " + where(stage, mb) + " needs a copy of "
                                 "version " + std::to_string(v) + " that was not kept");
        }
        copies.insert(v);
      }
      inFlight.insert(v);
    } else if (a.verb == PipeVerb::Backward) {
      if (plan.stashed[mb]) inFlight.erase(inFlight.find(plan.version[mb]));
      if (plan.updateAfter[i] >= 0) {
        if (!perMb) copies.insert(live);  // the next batch runs on it
        plan.peakCopies = std::max<int64_t>(plan.peakCopies, copies.size());
        live = plan.updateAfter[i];
      }
      dropUnused();
    }
    plan.peakCopies = std::max<int64_t>(plan.peakCopies, copies.size());
  }
  plan.endCopies = static_cast<int64_t>(copies.size());
  return plan;
}

} // namespace tdx::parallel
