// A collective algorithm is a plan: for one rank, a list of steps, each a set of actions
// (send, receive, receive-and-reduce, local copy, local reduce) on byte ranges of the
// op's buffers. Plans are pure data built from (rank, world, sizes): no transport, no
// torch, so tests check their invariants for any world size without a network, and one
// executor (executor.h) runs every plan over a Channel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tdx {
namespace algorithms {

// The buffers an op exposes to its plan.
//   Data:    one contiguous in/out buffer (all_reduce, broadcast, reduce: the result).
//   Send[i]: per-rank input blocks (all_to_all sends, reduce_scatter inputs, scatter's
//            root blocks, gather's own block as Send[0]).
//   Recv[i]: per-rank output blocks (all_gather blocks, all_to_all receives, gather's root
//            blocks, scatter's own block and reduce_scatter's output as Recv[0]).
//   Scratch: plan-private memory of Plan::scratchBytes.
enum class Region : uint8_t { Data, Send, Recv, Scratch };

struct Span {
  Region region = Region::Data;
  int32_t block = 0;  // Send/Recv: which block
  size_t offset = 0;  // bytes into the region or block
  size_t bytes = 0;
};

// Transfers of a step are posted together; local actions run once all of the step's
// transfers have finished. A step ends when everything in it is done.
enum class Verb : uint8_t {
  Send,        // src -> peer
  Recv,        // peer -> dst
  RecvReduce,  // dst = dst (op) what peer sends
  Copy,        // dst = src (local)
  Reduce,      // dst = dst (op) src (local)
};

struct Action {
  Verb verb = Verb::Send;
  int peer = -1;  // transfers only
  Span src;       // Send, Copy, Reduce
  Span dst;       // Recv, RecvReduce, Copy, Reduce
  // Send only: the peer takes this transfer with RecvReduce. The executor cuts such
  // transfers into segments on both sides, so each is reduced while the next is on the
  // wire; every other transfer moves as one message, since cutting it would only add
  // per-message handshakes (over TCP, 1 MiB segments halved a 64 MiB broadcast).
  bool segmented = false;
};

struct Step {
  std::vector<Action> actions;
};

struct Plan {
  std::vector<Step> steps;
  size_t scratchBytes = 0;
};

// What a plan is built from. Element counts and block sizes are the same on every rank
// except where a collective allows otherwise (all_to_all splits).
struct PlanArgs {
  int rank = 0;
  int size = 1;
  size_t elemSize = 1;
  size_t count = 0;               // Data elements (all_reduce, broadcast, reduce)
  std::vector<size_t> sendBytes;  // Send block sizes
  std::vector<size_t> recvBytes;  // Recv block sizes
  int root = 0;
  // Pipelined plans: bytes per chunk (0: the builder's own choice, which its cost
  // function assumes). Tests set it to exercise deep pipelines on small messages.
  size_t chunkBytes = 0;
};

// The terms of the α-β-γ cost model, for the busiest rank of the op.
struct Cost {
  double steps = 0;         // latency-bound rounds
  double bytesMoved = 0;    // bytes sent or received by the busiest rank, whichever is more
  double bytesReduced = 0;  // bytes that rank combines with the reduce kernel
};

const char* verbName(Verb v);
const char* regionName(Region r);

// Elements [begin, end) of `count` cut into `parts` nearly equal pieces (the first
// count % parts pieces get one more).
inline size_t pieceBegin(size_t count, size_t parts, size_t i) {
  const size_t base = count / parts, extra = count % parts;
  return i * base + (i < extra ? i : extra);
}
inline size_t pieceCount(size_t count, size_t parts, size_t i) {
  return count / parts + (i < count % parts ? 1 : 0);
}

// Building helpers shared by the plan builders.
inline Span dataSpan(size_t offset, size_t bytes) {
  return Span{Region::Data, 0, offset, bytes};
}
inline Span scratchSpan(size_t offset, size_t bytes) {
  return Span{Region::Scratch, 0, offset, bytes};
}
inline Span sendSpan(int block, size_t offset, size_t bytes) {
  return Span{Region::Send, block, offset, bytes};
}
inline Span recvSpan(int block, size_t offset, size_t bytes) {
  return Span{Region::Recv, block, offset, bytes};
}
inline Action sendTo(int peer, Span src) {
  Action a;
  a.verb = Verb::Send;
  a.peer = peer;
  a.src = src;
  return a;
}
// A send that the peer reduces as it lands (it posts RecvReduce).
inline Action reducedSendTo(int peer, Span src) {
  Action a = sendTo(peer, src);
  a.segmented = true;
  return a;
}
inline Action recvFrom(int peer, Span dst) {
  Action a;
  a.verb = Verb::Recv;
  a.peer = peer;
  a.dst = dst;
  return a;
}
inline Action recvReduceFrom(int peer, Span dst) {
  Action a;
  a.verb = Verb::RecvReduce;
  a.peer = peer;
  a.dst = dst;
  return a;
}
inline Action copy(Span src, Span dst) {
  Action a;
  a.verb = Verb::Copy;
  a.src = src;
  a.dst = dst;
  return a;
}
inline Action reduceInto(Span src, Span dst) {
  Action a;
  a.verb = Verb::Reduce;
  a.src = src;
  a.dst = dst;
  return a;
}

} // namespace algorithms
} // namespace tdx
