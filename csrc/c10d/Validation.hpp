// Argument checks done on the caller's thread before anything is queued or sent. Every
// message names the rank, group and op, the offending value, and what to do instead.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <vector>

#include "c10d/GroupChannel.hpp"
#include "common/types.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cuda.h"

namespace tdx {

// The element types tdx can reduce; data-movement ops accept any dtype.
std::optional<DType> toDType(at::ScalarType t);

// `ctx` is the message prefix, e.g. "[tdx r0/4 pg=0] all_reduce".
void checkTensor(const std::string& ctx, const at::Tensor& t, const std::string& name);
// A tensor the op writes: no two of its elements may share memory (an expand()ed view),
// since the result would be whichever write came last.
bool isWritable(const at::Tensor& t);
void checkWritable(const std::string& ctx, const at::Tensor& t, const std::string& name);
void checkSameLayout(const std::string& ctx, const at::Tensor& ref, const at::Tensor& t,
                     const std::string& name, bool sameNumel,
                     const std::string& refName = "the input");
// `output` may be `input` itself, or memory of its own; never a part of `input`.
void checkDisjointOrSame(const std::string& ctx, const at::Tensor& output,
                         const at::Tensor& input);
// `output` shares no memory with `input` (`name` in the message).
void checkDisjoint(const std::string& ctx, const at::Tensor& output, const at::Tensor& input,
                   const std::string& name, const std::string& outputName = "the output");
// The tensors of one output list (all_gather's, gather's) share no memory with each
// other: an element written twice would hold whichever write came last, which differs
// between algorithms and ranks.
void checkEntriesDisjoint(const std::string& ctx, const std::vector<at::Tensor>& list,
                          const std::string& what);
// reduce_scatter_tensor: an output inside the input must be exactly this rank's block
// (the in-place form); one shifted from it would be overwritten while still being read.
void checkOwnBlockOrDisjoint(const std::string& ctx, const at::Tensor& output,
                             const at::Tensor& input, int rank);
// A coalesced op reads every input as it was at the call, as gloo's do (they copy their
// inputs into one buffer first), though tdx runs its entries one after another: an input
// that shares memory with an earlier entry's output is replaced, in `inputs`, by a copy
// made now. Outputs of different entries that share memory are refused unless
// `outputsMayOverlap` and they have one dtype (all_reduce of views of one buffer writes
// the same value twice);
// elsewhere the result would depend on the order of the writes. `outputEntry[k]` is the
// entry output k belongs to (empty: output k is entry k's). Inputs are judged by address
// ranges, so an interleaved strided view may be copied without need, which costs a copy,
// never a wrong result; outputs are refused only where torch finds a real overlap.
void prepareCoalescedInputs(const std::string& ctx, std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& outputs, bool outputsMayOverlap,
                            const std::vector<size_t>& outputEntry = {});
void checkRank(const std::string& ctx, int64_t rank, int size, const char* what);
void checkListSize(const std::string& ctx, size_t got, size_t want, const char* what,
                   const char* why = "one per rank of the group");
void checkSingle(const std::string& ctx, const std::vector<at::Tensor>& tensors);

// How one ReduceOp is carried out on one dtype.
struct Reduction {
  ReduceKind kind = ReduceKind::Sum;
  DType dtype = DType::Float32;
  kernels::ReduceFn fn = nullptr;
  bool average = false;                // divide the SUM by the group size afterwards (AVG)
  bool premul = false;                 // scale inputs before the SUM (also float16 AVG)
  double premulFactor = 1.0;
  // An integer tensor scaled by an integer factor tensor: the factor exactly, modulo 2^64
  // (premulFactor holds it rounded to double, for messages).
  bool premulWhole = false;
  uint64_t premulWholeFactor = 0;
  at::Tensor premulTensor;             // a one-element factor read when the op runs
  std::string name;                    // "SUM", "AVG", ...
  // The dtype reduced and the reduce op, as the shared-memory windows compare them
  // across ranks ("float32 SUM"; a complex tensor's real dtype, as all_reduce and
  // all_reduce_into of it both reduce that). Made with the rest, on the caller's thread.
  std::string detail;
  // The same, as 4 bits of the tags of the reduction's messages (detailCode()).
  uint32_t code = 0;

  double factor() const;               // the PREMUL_SUM factor
  // How this rank's input enters the reduction (scaled by factor() when premul) and how
  // the result leaves it (divided by `groupSize` when average). Reads the factor
  // tensor, so it is made when the op runs.
  kernels::Load load(int groupSize) const;
  // The same for the CUDA multi-reduce: the reduction's kind and scaling (buffers and
  // count left to the caller); AVG divides by `groupSize` where `average`.
  kernels::MultiReduceArgs multiReduceArgs(int groupSize) const;
};
// AVG becomes a SUM divided afterwards (`average`), except on float16, whose sum may
// overflow where the average does not: a PREMUL_SUM by 1/groupSize there.
Reduction makeReduction(const std::string& ctx, const c10d::ReduceOp& op, at::ScalarType dtype,
                        int groupSize);
// The detail code an op's messages carry in their tags (transport/tag.h): its reduction's
// dtype and reduce op (null: none) and its root (-1: none), folded into 4 bits. Each
// enters with an odd multiplier, so ranks that differ in one of them alone always get
// different codes (roots: unless they differ by a multiple of 16); ranks that differ in
// two at once may get the same.
uint32_t detailCode(const Reduction* red, int root);
// What a reduction runs on: a complex tensor as its real and imaginary parts
// (view_as_real, the same memory), where SUM, AVG and PREMUL_SUM by a real factor act on
// each part alone, as they do on complex numbers; any other tensor as it is. Other ops
// are not defined on complex numbers and are refused, naming `name` and the op.
at::Tensor reducibleView(const std::string& ctx, const at::Tensor& t, const std::string& name,
                         const c10d::ReduceOp& op);

// A contiguous host image of a tensor for the duration of one op: the tensor itself when
// it is a contiguous CPU tensor, otherwise a staged copy that copyOut() writes back. The
// op's channel keeps the copy alive (GroupChannel::keep): its transfers use it.
class HostImage {
 public:
  HostImage() = default;
  HostImage(GroupChannel& ch, const at::Tensor& t, bool copyIn);
  char* data() const {
    return static_cast<char*>(host_.data_ptr());
  }
  size_t bytes() const {
    return host_.numel() * host_.element_size();
  }
  int64_t numel() const {
    return host_.numel();
  }
  const at::Tensor& host() const {
    return host_;
  }
  void copyOut();

 private:
  at::Tensor user_;
  at::Tensor host_;
  bool staged_ = false;
};

} // namespace tdx
