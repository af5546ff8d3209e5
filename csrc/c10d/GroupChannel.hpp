// The Channel an algorithm runs on: one op of one group, over the process's transport.
// Translates group ranks to endpoints, builds tags (group, sender, sequence, step),
// enforces the op's deadline and turns failures into errors that name the peer.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "algorithms/channel.h"
#include "transport/transport.h"

namespace tdx {

// "; lost so far: rank 1, rank 2" for the ranks of a group (endpoints indexed by group
// rank) whose connections failed, or "" when none did. When several ranks went down (a
// dead rank, then survivors that gave up and exited), the transfer that failed first need
// not be the one with the rank that died first, so errors list every lost rank.
std::string lostRanksNote(const transport::Transport& transport, const std::vector<int>& endpoints,
                          int self);

class GroupChannel final : public algorithms::Channel {
 public:
  GroupChannel(transport::Transport& transport, const std::vector<int>& endpoints, int rank,
               uint32_t groupId, uint64_t seq, transport::Clock::time_point deadline,
               const std::atomic<bool>& aborted);
  // Cancels whatever is still in flight (an op that threw part way).
  ~GroupChannel() override;

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return static_cast<int>(endpoints_.size());
  }
  transport::RequestPtr isend(int peer, uint32_t step, const void* data, size_t bytes) override;
  transport::RequestPtr irecv(int peer, uint32_t step, void* data, size_t bytes) override;
  void wait(const transport::RequestPtr& request) override;
  char* scratch(size_t bytes) override;

  // True when every request of this op has finished (so its buffers may be reused).
  // Cancels what it can and waits (at most 1 s, 100 ms for a lost peer) for the
  // receives that cannot be cancelled, once; when false, the scratch buffer is leaked
  // and the caller keeps the op's tensors alive.
  bool quiesce();

  transport::Clock::time_point deadline() const {
    return deadline_;
  }
  const std::atomic<bool>& abortedFlag() const {
    return aborted_;
  }
  // The algorithm the op ran (for the flight recorder); the last one set wins.
  void setAlgorithm(const std::string& name) {
    algorithm_ = name;
  }
  const std::string& algorithm() const {
    return algorithm_;
  }

  // Transfers of this op completed so far (the flight recorder's "step reached").
  uint32_t stepsDone() const {
    return stepsDone_;
  }
  // Steps done outside the channel (signals of a shared-memory algorithm).
  void addSteps(uint32_t n) {
    stepsDone_ += n;
  }

 private:
  struct Posted {
    transport::RequestPtr request;
    int peer;
    uint32_t step;
  };

  transport::Transport& transport_;
  const std::vector<int>& endpoints_;
  int rank_;
  uint32_t groupId_;
  uint64_t seq_;
  transport::Clock::time_point deadline_;
  const std::atomic<bool>& aborted_;
  std::vector<Posted> posted_;
  std::vector<char> scratch_;
  bool quiesced_ = false;
  bool clean_ = true;
  uint32_t stepsDone_ = 0;
  std::string algorithm_;
};

} // namespace tdx
