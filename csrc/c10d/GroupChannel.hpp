// The Channel an algorithm runs on: one op of one group, over the process's transport.
// Translates group ranks to endpoints, builds tags (group, sender, sequence, step),
// enforces the op's deadline and turns failures into errors that name the peer.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "algorithms/channel.h"
#include "algorithms/registry.h"
#include "c10d/RunningOp.hpp"
#include "transport/transport.h"

namespace tdx {

// A transfer of a collective that reached the group timeout: the peer never posted its
// side. The group then finds out which ranks reached the op (see ProcessGroupTDX).
struct TimedOut : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "rank 2" or "ranks 0, 1" (in the order given), for errors that list ranks; `one` and
// `many` replace the word (a sentence that starts with the list capitalises it).
std::string rankList(const std::vector<int>& ranks, const char* one = "rank ",
                     const char* many = "ranks ");

// "3 elements where 2 were expected (12 bytes where 8 were expected)" for a message of
// `got` bytes where `want` were posted, in elements of `elementBytes` where both are
// whole numbers of them (0: bytes only). "sent " or "received " goes before it.
std::string sizeMismatch(size_t got, size_t want, size_t elementBytes);

// "; lost so far: rank 1, rank 2" for the ranks of a group (endpoints indexed by group
// rank) whose connections failed, or "" when none did. When several ranks went down (a
// dead rank, then survivors that gave up and exited), the transfer that failed first need
// not be the one with the rank that died first, so errors list every lost rank.
std::string lostRanksNote(const transport::Transport& transport, const std::vector<int>& endpoints,
                          int self);

// A group's scratch memory, lent to each of its ops in turn. One buffer outlives the ops:
// a fresh one per op was zeroed and, from 16 MiB up, page-faulted in on every op, which
// on the development VM cost more than the transfer it staged (a 16 MiB message reduced
// on arrival took 31 ms instead of 8). Grows to the largest op's need, is not zeroed, and
// is given back after an op that needed more than kKeepBytes (a 128 MiB all_reduce at 2
// ranks stages 64 MiB), so a process with many groups does not hold a large one each.
class ScratchBuffer {
 public:
  static constexpr size_t kKeepBytes = size_t(64) << 20;

  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  // At least `bytes` (contents unspecified); earlier pointers are invalid after a growth.
  char* get(size_t bytes);
  // Frees the buffer if it grew past kKeepBytes (the next op allocates again).
  void trim();
  // The buffer, given up: a transfer that could not be stopped may still write it.
  struct Abandoned {
    std::shared_ptr<const void> owner;
    size_t bytes;
  };
  // The caller holds `owner` until those transfers end (Request::holdUntilReleased), and
  // the next op gets a new buffer.
  Abandoned abandon();

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
};

class GroupChannel final : public algorithms::Channel {
 public:
  // `scratch` is the group's; the channel borrows it for the op.
  GroupChannel(transport::Transport& transport, const std::vector<int>& endpoints, int rank,
               uint32_t groupId, uint64_t seq, transport::Clock::time_point deadline,
               const std::atomic<bool>& aborted, ScratchBuffer& scratch);
  // Cancels whatever is still in flight (an op that threw part way).
  ~GroupChannel() override;

  // The op's sequence number in its group (the same on every rank for one collective).
  uint64_t seq() const {
    return seq_;
  }
  // The collective its transfers name in their tags from now on, so ranks that called
  // different collectives as one op of the group cannot take each other's bytes. Until
  // it is set (the fingerprint check, which every collective runs alike) they name none.
  void setCollective(algorithms::Collective c) {
    collective_ = c;
  }
  // The size of the op's elements when its tensors all share one dtype (0 otherwise, and
  // for ops without tensors), so that a message of the wrong size is told in elements,
  // as the caller counts them, and not only in bytes. Set after the fingerprint check,
  // whose messages are text.
  void setElementBytes(size_t bytes) {
    elementBytes_ = bytes;
  }
  // What else the ranks must agree on for the op's next step (a reduction's dtype and
  // reduce op, set by each reducing step, entry by entry in a coalesced op), as text
  // owned by the caller for the op's life; the shared-memory ops compare it at their
  // first signal.
  const char* opDetail() const {
    return opDetail_;
  }
  // `code` is the same as 4 bits of the step's tags (detailCode()), with the op's root
  // where it has one, so ranks that disagree do not take each other's messages (unless
  // their codes coincide: transport/tag.h).
  void setOpDetail(const char* detail, uint32_t code) {
    opDetail_ = detail;
    detailCode_ = code;
  }
  // The op's detail code (detailCode()) and root (-1: none), for its tags from
  // setCollective() on, until a step sets its own (setOpDetail()).
  void setDetailCode(uint32_t code, int root) {
    detailCode_ = code;
    root_ = root;
  }
  // The running op's root (-1: it has none), as setDetailCode() gave it.
  int root() const {
    return root_;
  }
  // The op's first send to each peer completes only once the peer has taken it
  // (Transport::isend's `acknowledged`), for ops whose messages go one way between two
  // ranks (toward a root or away from it): a rank that alone names another root then
  // waits on a send no receive takes, and fails, where its message would have sat at the
  // peer while both ranks returned wrong data (a broadcast root that only sends, reduce
  // leaves that only send), and been taken by the op 2^11 later of its kind and root. A
  // peer that took the first message runs the op with this rank's root (the tags' detail
  // code) and takes the rest, so later sends (a chain's pipelined chunks) go as usual.
  // Stalled waits check the peers of sends still pending for their own message of the op
  // (throwIfSentBack).
  void setAcknowledgedSends(bool on) {
    acknowledgedSends_ = on;
  }
  // Run at each of a stalled wait's checks (every 100 ms) when set, with the rank the
  // wait is on: throws to end the op, as when that rank announced another way of
  // running it (ProcessGroupTDX::select).
  void setPeerCheck(std::function<void(int rank)> check) {
    peerCheck_ = std::move(check);
  }
  // Where each stalled wait is recorded (every 100 ms), for a caller's wait(timeout).
  void setRunningOp(RunningOp* running) {
    running_ = running;
  }
  // 0, 1, ... for each algorithm the op chooses in turn (a coalesced op chooses one per
  // entry): with the sequence number, which part of the op a rank has reached.
  uint32_t nextChoice() {
    return choices_++;
  }
  int rank() const override {
    return rank_;
  }
  int size() const override {
    return static_cast<int>(endpoints_.size());
  }
  transport::RequestPtr isend(int peer, uint32_t step, const void* data, size_t bytes) override;
  transport::RequestPtr irecv(int peer, uint32_t step, void* data, size_t bytes) override;
  void wait(const transport::RequestPtr& request) override {
    wait(request, Watch{});
  }
  // What ends a wait early. By default the loss of any rank of the group does (every step
  // of an op needs every rank, so a dead rank elsewhere makes this transfer hopeless); an
  // op that judges its peers one by one (the monitored barrier) watches only the
  // request's own peer, and may say itself what reaching the deadline means.
  struct Watch {
    bool anyRank = true;
    const char* timedOut = nullptr;  // the TimedOut text; the generic one when null
  };
  void wait(const transport::RequestPtr& request, const Watch& watch);
  char* scratch(size_t bytes) override;

  // For an op that judges each peer on its own (the monitored barrier), where wait()
  // would throw for the first failure of any rank: drives the transport until `request`
  // ends or `until` (at most the op's deadline) passes, and never throws. True when it
  // ended; ok() then says how.
  bool settle(const transport::RequestPtr& request, transport::Clock::time_point until);
  // Whether rank `peer`'s connection failed (the rank is gone).
  bool peerLost(int peer) const;
  // The collective rank `peer` called as this op, when its message for this op's
  // sequence number carries another kind than this op's (it waits unreceived); null when
  // none has come. Only a peer that still owes this rank a message of the op may be
  // asked: one that owes it nothing may be 2^11 ops ahead, its sequence bits wrapped.
  const char* otherOpFrom(int peer) const;
  // Throws "collective mismatch" naming both collectives when otherOpFrom(peer) finds one,
  // or when `peer`'s message of this op's kind carries another detail code (another
  // dtype, reduce op or root) at two checks of this op (the second look lets a message
  // of this rank's code that is still on its way land first).
  void throwIfOtherOpFrom(int peer) const;
  // For a rank that runs the op without messages (in the shared-memory window, or
  // setting it up) while `peer` has not reached it there: throws as throwIfOtherOpFrom()
  // when `peer`'s message for this op's sequence number waits here and is of another
  // collective, and returns true when it is of this one (`peer` runs the op on messages).
  // A peer that is behind has had every message it owed this rank for earlier ops
  // received, so nothing with wrapped sequence bits can be waiting from it.
  bool sentThisOp(int peer) const;

  // True when every request of this op has finished (so its buffers may be reused).
  // Cancels what it can and waits (at most 1 s, 100 ms for a lost peer) for the
  // receives that cannot be cancelled, once; when false, the scratch buffer and what
  // keep() holds stay with the requests that have not ended, and the caller hands the
  // op's tensors to holdUntilReleased().
  bool quiesce();
  // After a quiesce() that returned false: keeps `owner` (`bytes` of memory the op's
  // transfers use) until the transport has let go of every request that had not ended.
  void holdUntilReleased(std::shared_ptr<const void> owner, size_t bytes);

  // Keeps `owner` (memory that this op's transfers read or write, such as a staged copy
  // of a tensor) alive as long as the channel. An error unwinds the op's frames before
  // quiesce() runs, so a buffer owned only by a frame would be freed while a transfer
  // UCX has not stopped yet still uses it; one that cannot be stopped leaks it instead.
  void keep(std::shared_ptr<const void> owner, size_t bytes) {
    held_.push_back(std::move(owner));
    heldBytes_ += bytes;
  }
  // Between the entries of a coalesced op: once every transfer posted so far has been
  // waited for, nothing reads or writes what keep() holds, so an entry's staged copies
  // go before the next entry stages its own. Peak memory is then the largest entry's,
  // not the sum of all of them.
  void releaseHeld() {
    if (posted_.empty()) {
      held_.clear();
      heldBytes_ = 0;
    }
  }

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

  // The tag's op field: the collective's index plus one (0: none set).
  static uint32_t opField(algorithms::Collective c) {
    return static_cast<uint32_t>(c) + 1;
  }
  uint64_t tagOf(int sender, uint32_t step) const;
  // The tag of the oldest message from `peer` for this op's sequence number (any op, code
  // and step) that waits unreceived, if one does: one probe.
  std::optional<uint64_t> waitingTag(int peer) const;
  // waitingTag(peer) when it is of this op's kind; throws "collective mismatch" when it
  // is another collective's.
  std::optional<uint64_t> waitingOfThisOp(int peer) const;
  // The op field of waitingTag(peer), or -1 when none waits.
  int waitingField(int peer) const;
  // The collective that op field `field` names when it is another than this op's.
  const char* otherOp(int field) const;
  // Whether `found` (a waiting message's tag) was seen at an earlier check of this op;
  // records it when not. A message that waits through two checks is not one still on
  // its way ahead of the one this rank waits for.
  bool seenBefore(uint64_t found) const;
  // For a stalled acknowledged send to `peer`: throws when `peer` sent this rank a
  // message of this op too, where the op's messages go one way (setAcknowledgedSends).
  void throwIfSentBack(int peer) const;
  // Throws "collective mismatch": rank `peer` called `other` as this op.
  [[noreturn]] void throwOtherOp(int peer, const char* other) const;
  // Throws naming the other collective when a rank this op still waits to receive from
  // sent a message of this op's sequence number but another kind: it called a
  // different collective. With acknowledged sends, also throwIfSentBack() for the peer
  // of each send still pending.
  void checkForOtherOps() const;

  transport::Transport& transport_;
  const std::vector<int>& endpoints_;
  int rank_;
  uint32_t groupId_;
  uint64_t seq_;
  std::optional<algorithms::Collective> collective_;  // see setCollective()
  size_t elementBytes_ = 0;             // see setElementBytes()
  std::function<void(int)> peerCheck_;  // see setPeerCheck()
  RunningOp* running_ = nullptr;        // see setRunningOp()
  uint32_t choices_ = 0;                // see nextChoice()
  const char* opDetail_ = "";
  uint32_t detailCode_ = 0;  // see setOpDetail()
  int root_ = -1;            // see setDetailCode()
  bool acknowledgedSends_ = false;  // see setAcknowledgedSends()
  // Messages of this op's kind seen waiting where none should (seenBefore()).
  mutable std::vector<uint64_t> codeSeen_;
  transport::Clock::time_point deadline_;
  const std::atomic<bool>& aborted_;
  std::vector<Posted> posted_;
  ScratchBuffer& scratch_;
  bool scratchUsed_ = false;  // this op took the scratch (so an unclean end abandons it)
  std::vector<std::shared_ptr<const void>> held_;  // see keep()
  size_t heldBytes_ = 0;
  std::vector<transport::RequestPtr> unended_;     // what quiesce() could not end
  bool quiesced_ = false;
  uint32_t stepsDone_ = 0;
  std::string algorithm_;
};

} // namespace tdx
