// The 64-bit tag layout. Every message carries its sender's group rank so that a
// worker-wide receive can only match the intended peer, and collectives carry the
// group's sequence number and the op's kind, so a rank that skipped, reordered or
// swapped an op can never have its bytes consumed by a different op (a receive finds a
// peer's message of another kind by a probe and says so, or times out).
//
//   bit  63      kind: 0 collective, 1 point-to-point
//   bits 43..62  group id (20 bits, a hash of the group name)
//   bits 27..42  sender's rank in the group (16 bits: groups of up to 65535 ranks)
//   bits  0..26  collective: op kind (bits 23..26; 0 for the backend's own exchanges
//                before an op, such as the fingerprint check), the step's detail code
//                (bits 19..22), sequence number mod 2^11 (bits 8..18) and step mod 2^8
//                point-to-point: the user's tag (0 .. 2^23-1; bits 23..26 are 0)
//
// The detail code is what else the ranks must agree on for the step, folded into 4 bits
// (a reduction's dtype and reduce op, an op's root; 0 where there is none), so that a
// receive does not take a message sent with another reduce op or dtype: the bytes would
// be summed as the wrong type, or maxed where they should be summed, and the result would
// be wrong without a word. Ranks that disagree stall instead, and the stalled wait's
// probe finds the peer's message with another code and says so. 4 bits are not a
// fingerprint: codes may coincide where two of the three differ at once, and a rank that
// alone believes it is a broadcast's root receives nothing to compare (README,
// "Mismatch detection").
//
// Messages with equal (sender, tag) match in posting order (UCX tag matching is
// non-overtaking), so wrapping step or sequence numbers is safe while ops on one group
// run in order and take every message sent to them. A rank whose role in an op only
// sends (a broadcast root with TDX_ROOT_CHECK=0, whose sends are not acknowledged) may
// run ahead of its peers, even 2^11 ops: a probe for another op's message therefore asks
// only a peer that still owes the waiting op a message. A message no op took (sent,
// unacknowledged, under a root mismatch nothing caught) is taken by the op 2^11 later of
// the same kind, code, sender and step. Once its group is destroyed, by nothing: a
// group that leaves messages behind keeps its id from later groups (GroupIds::retire).
#pragma once

#include <cstdint>

namespace tdx {
namespace tag {

constexpr int kKindShift = 63;
constexpr int kGroupShift = 43;
constexpr int kGroupBits = 20;
constexpr int kRankShift = 27;
constexpr int kRankBits = 16;
constexpr int kOpShift = 23;
constexpr int kOpBits = 4;
constexpr int kCodeShift = 19;
constexpr int kCodeBits = 4;
constexpr int kSeqShift = 8;
constexpr int kSeqBits = 11;
constexpr int kStepBits = 8;
constexpr int kUserBits = 23;

static_assert(kGroupShift + kGroupBits == kKindShift, "group field must end below kind bit");
static_assert(kRankShift + kRankBits == kGroupShift, "rank field must end below group");
static_assert(kOpShift + kOpBits == kRankShift, "op field must end below rank");
static_assert(kCodeShift + kCodeBits == kOpShift, "code field must end below op");
static_assert(kSeqShift + kSeqBits == kCodeShift, "sequence field must end below code");
static_assert(kStepBits == kSeqShift, "step field fills the low bits");
static_assert(kUserBits <= kRankShift, "user tag fits below the rank field");

constexpr uint64_t kMaxRanks = uint64_t{1} << kRankBits;
// The two highest point-to-point tags are the backend's own: the goodbye each rank sends
// its peers when it shuts a group down, and (under fingerprint checks) the notice a
// receiver sends the sender of a message that did not match its receive. Users get
// 0 .. kMaxUserTag.
constexpr uint64_t kShutdownTag = (uint64_t{1} << kUserBits) - 1;
constexpr uint64_t kMismatchTag = kShutdownTag - 1;
constexpr uint64_t kMaxUserTag = kMismatchTag - 1;
constexpr uint64_t kGroupMask = (uint64_t{1} << kGroupBits) - 1;
// Every message of one group, either kind: probe with groupTag(id) under this mask.
constexpr uint64_t kGroupFieldMask = kGroupMask << kGroupShift;

constexpr uint64_t kRankFieldMask = ((uint64_t{1} << kRankBits) - 1) << kRankShift;
constexpr uint64_t kOpFieldMask = ((uint64_t{1} << kOpBits) - 1) << kOpShift;
constexpr uint64_t kCodeFieldMask = ((uint64_t{1} << kCodeBits) - 1) << kCodeShift;
constexpr uint32_t kMaxCode = (uint32_t{1} << kCodeBits) - 1;
constexpr uint64_t kStepFieldMask = (uint64_t{1} << kStepBits) - 1;
constexpr uint32_t kMaxOp = (uint32_t{1} << kOpBits) - 1;
constexpr uint64_t kFullMask = ~uint64_t{0};
// Receives from any source ignore the sender field.
constexpr uint64_t kAnySourceMask = ~kRankFieldMask;

// `op` (0 .. kMaxOp) is the caller's code for the kind of op; 0 for exchanges that any
// op may run first. `code` is the detail code (only its low kCodeBits count).
constexpr uint64_t collective(uint32_t group, uint32_t sender, uint32_t op, uint32_t code,
                              uint64_t seq, uint32_t step) {
  return (uint64_t{0} << kKindShift) | ((group & kGroupMask) << kGroupShift) |
         (uint64_t{sender} << kRankShift) | (uint64_t{op & kMaxOp} << kOpShift) |
         (uint64_t{code & kMaxCode} << kCodeShift) |
         ((seq & ((uint64_t{1} << kSeqBits) - 1)) << kSeqShift) | (step & kStepFieldMask);
}

constexpr uint32_t opOf(uint64_t t) {
  return static_cast<uint32_t>((t & kOpFieldMask) >> kOpShift);
}

constexpr uint32_t codeOf(uint64_t t) {
  return static_cast<uint32_t>((t & kCodeFieldMask) >> kCodeShift);
}

constexpr uint64_t pointToPoint(uint32_t group, uint32_t sender, uint64_t userTag) {
  return (uint64_t{1} << kKindShift) | ((group & kGroupMask) << kGroupShift) |
         (uint64_t{sender} << kRankShift) | (userTag & kShutdownTag);
}

constexpr uint64_t groupTag(uint32_t group) {
  return (group & kGroupMask) << kGroupShift;
}

constexpr uint32_t senderOf(uint64_t t) {
  return static_cast<uint32_t>((t >> kRankShift) & ((uint64_t{1} << kRankBits) - 1));
}

static_assert(senderOf(collective(5, 77, 9, 11, 3, 2)) == 77, "sender round trip");
static_assert(opOf(collective(5, 77, 9, 11, 3, 2)) == 9, "op round trip");
static_assert(codeOf(collective(5, 77, 9, 11, 3, 2)) == 11, "code round trip");
static_assert(collective(5, 77, 9, 11, 3, 2) != collective(5, 77, 8, 11, 3, 2), "ops tell apart");
static_assert(collective(5, 77, 9, 11, 3, 2) != collective(5, 77, 9, 10, 3, 2),
              "codes tell apart");
static_assert(senderOf(pointToPoint(5, 1234, kShutdownTag)) == 1234, "p2p sender round trip");
static_assert((collective(5, 77, 9, 11, 3, 2) & kGroupFieldMask) == groupTag(5) &&
                  (pointToPoint(5, 1, 7) & kGroupFieldMask) == groupTag(5) &&
                  (pointToPoint(6, 1, 7) & kGroupFieldMask) != groupTag(5),
              "a group's tags, either kind, are found under its group field");
static_assert(pointToPoint(5, 1, kMaxUserTag) != pointToPoint(5, 1, kShutdownTag) &&
                  pointToPoint(5, 1, kMaxUserTag) != pointToPoint(5, 1, kMismatchTag),
              "the backend's tags are out of the users' range");

} // namespace tag
} // namespace tdx
