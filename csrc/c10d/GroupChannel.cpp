#include "c10d/GroupChannel.hpp"

#include <algorithm>
#include <stdexcept>

#include "transport/tag.h"

namespace tdx {

using transport::Clock;
using transport::RequestPtr;

std::string lostRanksNote(const transport::Transport& transport, const std::vector<int>& endpoints,
                          int self) {
  std::string lost;
  for (size_t q = 0; q < endpoints.size(); ++q) {
    if (static_cast<int>(q) != self && transport.endpointFailed(endpoints[q])) {
      lost += (lost.empty() ? "rank " : ", rank ") + std::to_string(q);
    }
  }
  return lost.empty() ? "" : "; lost so far: " + lost;
}

std::string sizeMismatch(size_t got, size_t want, size_t elementBytes) {
  const std::string bytes =
      std::to_string(got) + " bytes where " + std::to_string(want) + " were expected";
  if (elementBytes == 0 || want % elementBytes != 0) return bytes;
  const std::string wanted = std::to_string(want / elementBytes);
  if (got % elementBytes != 0) {
    return bytes + " (" + wanted + " elements of " + std::to_string(elementBytes) +
           " bytes; what came is no whole number of them)";
  }
  return std::to_string(got / elementBytes) + " elements where " + wanted + " were expected (" +
         bytes + ")";
}

std::string rankList(const std::vector<int>& ranks, const char* one, const char* many) {
  std::string s = ranks.size() == 1 ? one : many;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

char* ScratchBuffer::get(size_t bytes) {
  if (bytes > size_) {
    data_.reset();  // the old contents are not needed: give the memory back first
    size_ = 0;
    data_.reset(new char[bytes]);  // default-initialised: not zeroed
    size_ = bytes;
  }
  return data_.get();
}

void ScratchBuffer::trim() {
  if (size_ > kKeepBytes) {
    data_.reset();
    size_ = 0;
  }
}

ScratchBuffer::Abandoned ScratchBuffer::abandon() {
  Abandoned given{std::shared_ptr<const void>(
                      data_.release(), [](const void* p) { delete[] static_cast<const char*>(p); }),
                  size_};
  size_ = 0;
  return given;
}

GroupChannel::GroupChannel(transport::Transport& transport, const std::vector<int>& endpoints,
                           int rank, uint32_t groupId, uint64_t seq,
                           Clock::time_point deadline, const std::atomic<bool>& aborted,
                           ScratchBuffer& scratch)
    : transport_(transport),
      endpoints_(endpoints),
      rank_(rank),
      groupId_(groupId),
      seq_(seq),
      deadline_(deadline),
      aborted_(aborted),
      scratch_(scratch) {}

GroupChannel::~GroupChannel() {
  if (quiesce()) scratch_.trim();
}

bool GroupChannel::quiesce() {
  // Called on an op's error and again by the destructor: the waiting happens once.
  if (quiesced_) return unended_.empty();
  quiesced_ = true;
  for (auto& p : posted_) {
    if (!p.request->done()) transport_.cancel(*p.request, "op abandoned after an error");
  }
  const auto now = Clock::now();
  for (auto& p : posted_) {
    if (p.request->done()) {
      // UCX may still write an orphaned request's buffer.
      if (p.request->orphaned.load()) unended_.push_back(p.request);
      continue;
    }
    if (p.request->isSend) {
      // A send only reads its buffer, and one that UCX cannot cancel (a rendezvous
      // waiting for a peer that has given up on it) may wait for that peer's exit: it
      // is not waited for; the buffers are kept alive instead.
      unended_.push_back(p.request);
      continue;
    }
    // A receive UCX could not cancel is already matched. From a live peer it ends in a
    // moment; from a lost one it may never end (a rendezvous from a dead process), and
    // whatever that peer wrote before it died is already in this process's FIFOs, which
    // the progress thread drains within microseconds.
    const bool lost = transport_.endpointFailed(endpoints_.at(p.peer));
    const auto until = now + (lost ? std::chrono::milliseconds(100) : std::chrono::seconds(1));
    // Ended by a lost peer's sweep during the wait, it is orphaned: UCX may still write.
    if (!transport_.wait(*p.request, until) || p.request->orphaned.load()) {
      unended_.push_back(p.request);
    }
  }
  if (!unended_.empty()) {
    // A transfer may still touch these: they stay until the transport lets go of it.
    if (scratchUsed_) {
      auto given = scratch_.abandon();
      holdUntilReleased(std::move(given.owner), given.bytes);
    }
    if (!held_.empty()) {
      holdUntilReleased(
          std::make_shared<const std::vector<std::shared_ptr<const void>>>(std::move(held_)),
          heldBytes_);
      held_.clear();
      heldBytes_ = 0;
    }
  }
  return unended_.empty();
}

void GroupChannel::holdUntilReleased(std::shared_ptr<const void> owner, size_t bytes) {
  if (unended_.empty()) return;  // nothing uses it any more: it may go now
  // One hold shared by every request that may still use the memory: it goes with the
  // last of them, and is counted once.
  auto hold = transport::countedHold(std::move(owner), bytes);
  for (const auto& r : unended_) r->holdUntilReleased(hold);
}

uint64_t GroupChannel::tagOf(int sender, uint32_t step) const {
  static_assert(algorithms::kNumCollectives <= tag::kMaxOp, "every kind fits the op field");
  return collective_ ? tag::collective(groupId_, static_cast<uint32_t>(sender),
                                       opField(*collective_), detailCode_, seq_, step)
                     : tag::collective(groupId_, static_cast<uint32_t>(sender), 0, 0, seq_, step);
}

RequestPtr GroupChannel::isend(int peer, uint32_t step, const void* data, size_t bytes) {
  uint64_t t = tagOf(rank_, step);
  // Only the op's first send to the peer (see setAcknowledgedSends()).
  const bool acknowledged =
      acknowledgedSends_ && std::none_of(posted_.begin(), posted_.end(), [&](const Posted& p) {
        return p.peer == peer && p.request->isSend;
      });
  auto r = transport_.isend(endpoints_.at(peer), t, data, bytes, transport::MemType::Host,
                            nullptr, acknowledged);
  posted_.push_back({r, peer, step});
  return r;
}

RequestPtr GroupChannel::irecv(int peer, uint32_t step, void* data, size_t bytes) {
  uint64_t t = tagOf(peer, step);
  auto r = transport_.irecv(endpoints_.at(peer), t, tag::kFullMask, data, bytes,
                            transport::MemType::Host);
  posted_.push_back({r, peer, step});
  return r;
}

std::optional<uint64_t> GroupChannel::waitingTag(int peer) const {
  // Any op, code and step: another collective's first message need not carry the step
  // this rank waits on. One probe, made only after a stalled wait, so the cost stays
  // off the ops that run as they should.
  const uint64_t want = tag::collective(groupId_, static_cast<uint32_t>(peer), 0, 0, seq_, 0);
  uint64_t found = 0;
  if (!transport_.probe(want, ~(tag::kStepFieldMask | tag::kOpFieldMask | tag::kCodeFieldMask),
                        found)) {
    return std::nullopt;
  }
  return found;
}

int GroupChannel::waitingField(int peer) const {
  const auto found = waitingTag(peer);
  return found ? static_cast<int>(tag::opOf(*found)) : -1;
}

const char* GroupChannel::otherOp(int field) const {
  // Field 0 is the backend's own exchange before an op (the fingerprint check), which
  // every rank runs alike: it names no collective.
  if (!collective_ || field <= 0 || field > algorithms::kNumCollectives) return nullptr;
  if (static_cast<uint32_t>(field) == opField(*collective_)) return nullptr;
  return algorithms::collectiveCallName(static_cast<algorithms::Collective>(field - 1));
}

const char* GroupChannel::otherOpFrom(int peer) const {
  // A peer calls one collective per sequence number: its oldest waiting message for
  // this one says which.
  return otherOp(waitingField(peer));
}

bool GroupChannel::sentThisOp(int peer) const {
  if (!collective_) return false;
  const int field = waitingField(peer);
  if (const char* other = otherOp(field)) throwOtherOp(peer, other);
  return field == static_cast<int>(opField(*collective_));
}

void GroupChannel::checkForOtherOps() const {
  if (!collective_) return;
  std::vector<int> asked;
  std::vector<int> sentTo;
  for (const auto& p : posted_) {
    if (p.request->done()) continue;
    if (p.request->isSend) {
      // A peer that has not taken this rank's message has not finished the op with this
      // rank's root: it cannot be ahead (below).
      if (!acknowledgedSends_) continue;
      if (std::find(sentTo.begin(), sentTo.end(), p.peer) != sentTo.end()) continue;
      sentTo.push_back(p.peer);
      throwIfSentBack(p.peer);
      continue;
    }
    // A rank that still owes this op a message has not finished it as this op's kind:
    // its message of the same sequence bits and another kind is a mismatch either way.
    // (A rank that owes nothing may be 2^11 ops ahead, its sequence bits wrapped.)
    if (std::find(asked.begin(), asked.end(), p.peer) != asked.end()) continue;
    asked.push_back(p.peer);
    throwIfOtherOpFrom(p.peer);
  }
}

std::optional<uint64_t> GroupChannel::waitingOfThisOp(int peer) const {
  if (!collective_) return std::nullopt;
  const auto found = waitingTag(peer);
  if (!found) return std::nullopt;
  const uint32_t field = tag::opOf(*found);
  if (const char* other = otherOp(static_cast<int>(field))) throwOtherOp(peer, other);
  if (field != opField(*collective_)) return std::nullopt;  // the fingerprint exchange's
  return found;
}

void GroupChannel::throwIfOtherOpFrom(int peer) const {
  const auto found = waitingOfThisOp(peer);
  const uint32_t mine = detailCode_ & tag::kMaxCode;
  if (!found || tag::codeOf(*found) == mine) return;
  // It has waited unreceived since, while this rank waited on that peer for a message of
  // its own code.
  if (!seenBefore(*found)) return;
  std::string detail = opDetail_;
  if (root_ >= 0) detail += (detail.empty() ? "root " : ", root ") + std::to_string(root_);
  throw std::runtime_error(
      "collective mismatch: rank " + std::to_string(peer) + " runs this op (" +
      algorithms::collectiveCallName(*collective_) +
      ") with another dtype, reduce op or root than this rank" +
      (detail.empty() ? std::string() : " (" + detail + ")") +
      ": its message for the op arrived here with detail code " +
      std::to_string(tag::codeOf(*found)) + " where this rank's is " + std::to_string(mine) +
      ". Every rank must pass the same dtype, reduce op and root to a collective; "
      "TDX_DEBUG=DETAIL names both ranks' calls");
}

bool GroupChannel::seenBefore(uint64_t found) const {
  if (std::find(codeSeen_.begin(), codeSeen_.end(), found) != codeSeen_.end()) return true;
  codeSeen_.push_back(found);
  return false;
}

void GroupChannel::throwIfSentBack(int peer) const {
  const auto found = waitingOfThisOp(peer);
  if (!found || !seenBefore(*found)) return;
  throw std::runtime_error(
      "collective mismatch: rank " + std::to_string(peer) + " runs this op (" +
      algorithms::collectiveCallName(*collective_) + ") with another root than this rank" +
      (root_ >= 0 ? " (root " + std::to_string(root_) + ")" : std::string()) +
      ": each sends the other its message for the op, which goes one way between two "
      "ranks (rank " + std::to_string(peer) + "'s arrived here, and this rank's waits for "
      "rank " + std::to_string(peer) + " to take it). Every rank must pass the same root "
      "(and algorithm pins) to a collective; TDX_DEBUG=DETAIL names both ranks' calls");
}

void GroupChannel::throwOtherOp(int peer, const char* other) const {
  throw std::runtime_error(
      std::string("collective mismatch: rank ") + std::to_string(peer) + " called " + other +
      " as this op of the group (its message arrived here) where this rank called " +
      algorithms::collectiveCallName(*collective_) +
      ". Every rank must call the same collectives in the same order; TDX_DEBUG=DETAIL "
      "also compares dtypes, shapes, roots and reduce ops");
}

bool GroupChannel::settle(const RequestPtr& r, Clock::time_point until) {
  return transport_.wait(*r, std::min(until, deadline_));
}

bool GroupChannel::peerLost(int peer) const {
  return transport_.endpointFailed(endpoints_.at(peer));
}

void GroupChannel::wait(const RequestPtr& r, const Watch& watch) {
  auto it = std::find_if(posted_.begin(), posted_.end(),
                         [&](const Posted& p) { return p.request == r; });
  if (it == posted_.end()) throw std::logic_error("request does not belong to this op");
  const Posted p = *it;
  // Wake up now and then to notice an abort of the group.
  while (!transport_.wait(*r, std::min(deadline_, Clock::now() + std::chrono::milliseconds(100)))) {
    if (aborted_.load()) {
      throw std::runtime_error(
          "the process group was shut down (destroyed or aborted) while waiting for rank " +
          std::to_string(p.peer));
    }
    // A rank of the group that died makes this op impossible even when the transfer we
    // wait on is with a live rank (which may itself be stuck on the dead one): name the
    // lost rank now instead of timing out on an innocent neighbour.
    for (size_t q = 0; q < endpoints_.size(); ++q) {
      if (!watch.anyRank && static_cast<int>(q) != p.peer) continue;
      if (static_cast<int>(q) != rank_ && transport_.endpointFailed(endpoints_[q])) {
        throw std::runtime_error("rank " + std::to_string(q) +
                                 " of the group was lost (its connection failed) while this "
                                 "rank waited for rank " + std::to_string(p.peer) + " (step " +
                                 std::to_string(p.step) + ")");
      }
    }
    if (running_) running_->stalledOn(p.peer, RunningOp::kMessages);
    checkForOtherOps();
    if (peerCheck_) peerCheck_(p.peer);
    if (Clock::now() >= deadline_) {
      if (watch.timedOut != nullptr) throw TimedOut(watch.timedOut);
      throw TimedOut(
          std::string("timed out waiting to ") + (r->isSend ? "send to" : "receive from") +
          " rank " + std::to_string(p.peer) + " (step " + std::to_string(p.step) +
          "); that rank has not reached this op, is behind, is gone, or ran this op with "
          "another algorithm or root and finished it without this rank. Every rank must "
          "call the same collectives in the same order, with the same roots and algorithm "
          "pins");
    }
  }
  if (!r->ok() && r->truncated) {
    // UCX does not say how long the message was, only that it did not fit.
    const std::string want = std::to_string(r->postedBytes) + " bytes";
    throw std::runtime_error(
        "rank " + std::to_string(p.peer) + " sent more than the " +
        (elementBytes_ != 0 && r->postedBytes % elementBytes_ == 0
             ? std::to_string(r->postedBytes / elementBytes_) + " elements (" + want + ")"
             : want) +
        " this rank expected (step " + std::to_string(p.step) +
        "): the ranks passed tensors of different sizes or dtypes to this op, or pinned "
        "different algorithms for it");
  }
  if (!r->ok()) {
    throw std::runtime_error(std::string(r->isSend ? "send to" : "receive from") + " rank " +
                             std::to_string(p.peer) + " failed (step " +
                             std::to_string(p.step) + "): " + r->error +
                             lostRanksNote(transport_, endpoints_, rank_));
  }
  if (!r->isSend && r->receivedBytes != r->postedBytes) {
    // Only this rank can see it: the op's failure is told to the peers (runTask).
    throw std::runtime_error("rank " + std::to_string(p.peer) + " sent " +
                             sizeMismatch(r->receivedBytes, r->postedBytes, elementBytes_) +
                             " (step " + std::to_string(p.step) +
                             "): the ranks passed tensors of different sizes or dtypes to "
                             "this op, or pinned different algorithms for it");
  }
  ++stepsDone_;
  // Finished requests leave the list so it only holds what is still in flight.
  *it = posted_.back();
  posted_.pop_back();
}

char* GroupChannel::scratch(size_t bytes) {
  // A plan that asks for none moves nothing through it, so an unclean end need not give
  // it up.
  if (bytes > 0) scratchUsed_ = true;
  return scratch_.get(bytes);
}

} // namespace tdx
