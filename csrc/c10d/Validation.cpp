#include "c10d/Validation.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>

#include "transport/tag.h"

namespace tdx {

std::optional<DType> toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kByte: return DType::UInt8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kBool: return DType::Bool;
    default: return std::nullopt;
  }
}

static std::string shapeOf(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes() << " on " << t.device();
  return os.str();
}

void checkTensor(const std::string& ctx, const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.defined(), ctx, ": ", name, " is an undefined tensor; pass a real tensor");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, ctx, ": ", name, " has layout ", t.layout(),
                   "; this op takes dense (strided) tensors only (all_reduce also takes sparse "
                   "COO ones). Convert with .to_dense()");
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), ctx, ": ", name, " is on ", t.device(),
                    "; tdx handles cpu and cuda tensors. Move it with .cpu() or .cuda()");
}

bool isWritable(const at::Tensor& t) {
  return !t.defined() || at::has_internal_overlap(t) != at::MemOverlap::Yes;
}

void checkWritable(const std::string& ctx, const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(isWritable(t), ctx,
                    ": ", name, " ", shapeOf(t), " with strides ", t.strides(),
                    " has elements that share memory (an expand()ed or as_strided view), and "
                    "the op writes it; pass a tensor that owns its elements, e.g. t.clone()");
}

void checkSameLayout(const std::string& ctx, const at::Tensor& ref, const at::Tensor& t,
                     const std::string& name, bool sameNumel, const std::string& refName) {
  checkTensor(ctx, t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), ctx, ": ", name, " is ", shapeOf(t),
                   " but ", refName, " is ", shapeOf(ref),
                   "; every tensor of one op must have the same dtype");
  TORCH_CHECK_VALUE(t.device() == ref.device(), ctx, ": ", name, " is ", shapeOf(t),
                    " but ", refName, " is ", shapeOf(ref),
                    "; every tensor of one op must be on the same device");
  if (sameNumel) {
    TORCH_CHECK_VALUE(t.numel() == ref.numel(), ctx, ": ", name, " is ", shapeOf(t), " with ",
                      t.numel(), " elements but ", refName, " has ", ref.numel(),
                      "; give every tensor in the list the size of ", refName);
  }
}

void checkDisjointOrSame(const std::string& ctx, const at::Tensor& output,
                         const at::Tensor& input) {
  // Partial overlap would let the op read input the output already overwrote. (Tensors
  // too strided to judge are staged into copies of their own, which is safe.)
  TORCH_CHECK_VALUE(at::get_overlap_status(output, input) != at::MemOverlapStatus::Partial, ctx,
                    ": output (", shapeOf(output), ") and input (", shapeOf(input),
                    ") share part of their memory; pass the same tensor for an in-place op, "
                    "or an output that does not overlap the input");
}

void checkDisjoint(const std::string& ctx, const at::Tensor& output, const at::Tensor& input,
                   const std::string& name, const std::string& outputName) {
  if (output.numel() == 0 || input.numel() == 0) return;
  const auto overlap = at::get_overlap_status(output, input);
  TORCH_CHECK_VALUE(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::TooHard,
                    ctx, ": ", outputName, " (", shapeOf(output), ") shares memory with ", name, " (",
                    shapeOf(input), "), which is read after the output is written; pass an "
                    "output of its own");
}

void checkEntriesDisjoint(const std::string& ctx, const std::vector<at::Tensor>& list,
                          const std::string& what) {
  auto refuse = [&](size_t i, size_t j) {
    TORCH_CHECK_VALUE(false, ctx, ": entries ", std::min(i, j), " and ", std::max(i, j), " of ",
                      what, " share memory, so their elements would be written twice with "
                      "different values; pass a tensor of its own for each entry");
  };
  // A list holds one tensor per rank: comparing every pair would cost n^2 / 2 overlap
  // checks per op on the caller's thread. Entries of different storages cannot share
  // memory; within a storage, dense entries are byte intervals, which overlap only if one
  // starts before the furthest end of those that start earlier. Other (strided) entries
  // are compared pair by pair with the rest of their storage.
  struct Entry {
    const void* storage;
    uintptr_t begin, end;
    size_t index;
    bool dense;
  };
  std::vector<Entry> entries;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    if (t.numel() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    entries.push_back({t.storage().data(), begin, begin + t.numel() * t.element_size(), i,
                       t.is_non_overlapping_and_dense()});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.storage != b.storage) return std::less<const void*>()(a.storage, b.storage);
    return a.begin != b.begin ? a.begin < b.begin : a.index < b.index;
  });
  for (size_t a = 0; a < entries.size();) {
    size_t b = a;
    while (b < entries.size() && entries[b].storage == entries[a].storage) ++b;
    const Entry* furthest = nullptr;  // of the dense entries so far, the one ending last
    for (size_t k = a; k < b; ++k) {
      const Entry& e = entries[k];
      if (!e.dense) continue;
      if (furthest != nullptr && e.begin < furthest->end) refuse(furthest->index, e.index);
      if (furthest == nullptr || e.end > furthest->end) furthest = &e;
    }
    for (size_t k = a; k < b; ++k) {
      if (entries[k].dense) continue;
      for (size_t m = a; m < b; ++m) {
        if (m == k || (!entries[m].dense && m < k)) continue;  // each strided pair once
        const auto overlap = at::get_overlap_status(list[entries[k].index],
                                                    list[entries[m].index]);
        if (overlap == at::MemOverlapStatus::Full || overlap == at::MemOverlapStatus::Partial) {
          refuse(entries[k].index, entries[m].index);
        }
      }
    }
    a = b;
  }
}

void checkOwnBlockOrDisjoint(const std::string& ctx, const at::Tensor& output,
                             const at::Tensor& input, int rank) {
  // A non-contiguous tensor is staged through a copy of its own (and the GPU path takes
  // only contiguous ones), so the output is written only after the input has been read.
  if (output.numel() == 0 || !output.is_contiguous() || !input.is_contiguous()) return;
  const auto overlap = at::get_overlap_status(output, input);
  if (overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::TooHard) return;
  const int64_t es = output.element_size();
  const char* own = static_cast<const char*>(input.data_ptr()) + rank * output.numel() * es;
  const int64_t at = (static_cast<const char*>(output.data_ptr()) -
                      static_cast<const char*>(input.data_ptr())) / es;
  TORCH_CHECK_VALUE(output.data_ptr() == own, ctx, ": output (", shapeOf(output),
                    ") shares memory with input (", shapeOf(input), ") from element ", at,
                    " of the input, but in place it must be this rank's block, elements [",
                    rank * output.numel(), ", ", (rank + 1) * output.numel(),
                    "); pass input.view(-1).chunk(world_size)[", rank,
                    "], or an output that does not overlap the input");
}

namespace {

// The bytes a tensor's elements span (strides are never negative in torch).
struct Extent {
  c10::Device device;
  uintptr_t begin;
  uintptr_t end;
  size_t index;  // in the outputs or the inputs
  size_t entry;
  bool output;
};

Extent extentOf(const at::Tensor& t, size_t index, size_t entry, bool output) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return Extent{t.device(), begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size()),
                index, entry, output};
}

} // namespace

void prepareCoalescedInputs(const std::string& ctx, std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& outputs, bool outputsMayOverlap,
                            const std::vector<size_t>& outputEntry) {
  if (inputs.size() < 2) return;  // one entry: nothing runs before it
  std::vector<bool> flagged(inputs.size(), false);
  std::vector<Extent> extents;
  extents.reserve(outputs.size() + inputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k].numel() == 0) continue;
    extents.push_back(extentOf(outputs[k], k, outputEntry.empty() ? k : outputEntry[k], true));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].numel() > 0) extents.push_back(extentOf(inputs[i], i, i, false));
  }
  // Sorted by device, then start: one sweep finds every overlapping pair, and the common
  // case (all distinct memory) costs a sort of a few entries.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    if (a.device != b.device) {
      return a.device.type() != b.device.type() ? a.device.type() < b.device.type()
                                                : a.device.index() < b.device.index();
    }
    return a.begin < b.begin;
  });
  std::vector<const Extent*> open;
  for (const Extent& e : extents) {
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](const Extent* o) {
                                return o->device != e.device || o->end <= e.begin;
                              }),
               open.end());
    for (const Extent* o : open) {
      if (o->entry == e.entry || (!o->output && !e.output)) continue;
      if (o->output && e.output) {
        // Both written: unless every write is the same value (all_reduce of views of one
        // buffer, of one dtype), the result would depend on the order of the writes.
        // Spans that only interleave (strided views) are told apart where torch can
        // judge them.
        if (outputsMayOverlap &&
            outputs[o->index].scalar_type() == outputs[e.index].scalar_type()) {
          continue;
        }
        const auto overlap = at::get_overlap_status(outputs[o->index], outputs[e.index]);
        TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full &&
                              overlap != at::MemOverlapStatus::Partial,
                          ctx, ": the outputs of entries ",
                          std::min(o->entry, e.entry), " and ", std::max(o->entry, e.entry),
                          " share memory, so its elements would be written twice with "
                          "different values; give each entry an output of its own");
        continue;
      }
      const Extent& out = o->output ? *o : e;
      const Extent& in = o->output ? e : *o;
      // Entries run in order: only an earlier entry's output is written before this
      // input is read.
      if (out.entry < in.entry) flagged[in.entry] = true;
    }
    open.push_back(&e);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (flagged[i]) inputs[i] = inputs[i].clone();
  }
}

void checkRank(const std::string& ctx, int64_t rank, int size, const char* what) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, ctx, ": ", what, " ", rank,
                    " is not a rank of this group (valid: 0..", size - 1, ")");
}

void checkListSize(const std::string& ctx, size_t got, size_t want, const char* what,
                   const char* why) {
  TORCH_CHECK_VALUE(got == want, ctx, ": ", what, " has ", got, " entries but must have ",
                    want, " (", why, ")");
}

void checkSingle(const std::string& ctx, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(tensors.size() == 1, ctx, ": expected exactly one tensor, got ",
                    tensors.size(), "; tdx runs one tensor per process (one device per rank)");
  checkTensor(ctx, tensors[0], "tensor");
}

double Reduction::factor() const {
  if (premulTensor.defined()) return premulTensor.item<double>();
  return premulFactor;
}

kernels::Load Reduction::load(int groupSize) const {
  kernels::Load l;
  l.divisor = average ? groupSize : 1;
  l.dtype = dtype;
  l.scales = premul;
  l.factor = premul ? factor() : 1.0;
  l.exactWhole = premul && premulWhole;
  l.wholeFactor = premulWholeFactor;
  return l;
}

kernels::MultiReduceArgs Reduction::multiReduceArgs(int groupSize) const {
  kernels::MultiReduceArgs a;
  a.dtype = dtype;
  a.kind = kind;
  a.premul = premul;
  a.premulFactor = premul ? factor() : 1.0;
  a.exactWhole = premul && premulWhole;
  a.wholeFactor = premulWholeFactor;
  a.divisor = average ? groupSize : 1;
  return a;
}

namespace {

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "this reduce op";
  }
}

} // namespace

uint32_t detailCode(const Reduction* red, int root) {
  const uint32_t r = root > 0 ? static_cast<uint32_t>(root) : 0;
  return ((red ? red->code : 0) + 7u * r) & tag::kMaxCode;
}

Reduction makeReduction(const std::string& ctx, const c10d::ReduceOp& op,
                        at::ScalarType scalar, int groupSize) {
  Reduction r;
  auto dt = toDType(scalar);
  TORCH_CHECK_TYPE(dt.has_value(), ctx, ": cannot reduce tensors of dtype ", scalar,
                   "; tdx reduces float32/64, float16, bfloat16, int8/16/32/64, uint8, bool "
                   "and complex (as its real and imaginary parts)");
  r.dtype = *dt;
  r.name = reduceOpName(op.op_);
  r.detail = std::string(dtypeName(r.dtype)) + " " + r.name;
  // The ops' values (0 .. 8) and the dtypes' (0 .. 9) are each below 16, and 5 is odd:
  // a change of either alone changes the code.
  r.code = static_cast<uint32_t>(op.op_) + 5u * static_cast<uint32_t>(r.dtype);
  const bool floating = isFloating(r.dtype);
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r.kind = ReduceKind::Sum; break;
    case c10d::ReduceOp::PRODUCT: r.kind = ReduceKind::Product; break;
    case c10d::ReduceOp::MIN: r.kind = ReduceKind::Min; break;
    case c10d::ReduceOp::MAX: r.kind = ReduceKind::Max; break;
    case c10d::ReduceOp::BAND: r.kind = ReduceKind::BitAnd; break;
    case c10d::ReduceOp::BOR: r.kind = ReduceKind::BitOr; break;
    case c10d::ReduceOp::BXOR: r.kind = ReduceKind::BitXor; break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_TYPE(r.dtype != DType::Bool, ctx,
                       ": AVG is not defined for bool tensors; use SUM (logical or) or MIN");
      r.kind = ReduceKind::Sum;
      if (r.dtype == DType::Float16) {
        // Each rank scales its share by 1/size before the sum (as NCCL does): a sum of
        // float16 values each within range can overflow, their average cannot.
        r.premul = true;
        r.premulFactor = 1.0 / groupSize;
      } else {
        // Sum, then divide (integers truncate): rounded once at the end, so where the sum
        // is exact the result is the correctly rounded mean, as gloo's is. Scaling each
        // share by a rounded 1/size first (NCCL's way) is a unit in the last place off
        // for a third to a half of the means of three ranks' integers.
        r.average = true;
      }
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_TYPE(r.dtype != DType::Bool, ctx,
                       ": PREMUL_SUM is not defined for bool tensors; use SUM");
      r.kind = ReduceKind::Sum;
      r.premul = true;
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK_VALUE(sup != nullptr, ctx,
                        ": PREMUL_SUM needs a factor; build the op with "
                        "torch.distributed._make_nccl_premul_sum(factor)");
      if (sup->tensor_factor.defined()) {
        TORCH_CHECK_VALUE(sup->tensor_factor.numel() == 1, ctx,
                          ": the PREMUL_SUM factor tensor must have one element, got ",
                          sup->tensor_factor.numel());
        // Refused here, at the call: read when the op runs it would fail on the worker
        // thread and break the group. (torch hands complex tensors over as real views.)
        TORCH_CHECK_TYPE(!sup->tensor_factor.is_complex(), ctx,
                         ": the PREMUL_SUM factor is a complex tensor, which would mix the real "
                         "and imaginary parts; multiply the tensor by it before the op and use "
                         "SUM");
        if (floating) {
          r.premulTensor = sup->tensor_factor;  // read when the op runs
        } else {
          // Integer tensors read it now (a GPU factor costs a sync) and keep that value:
          // read when the op runs, a NaN would scale by 0 without a word.
          const at::Tensor& f = sup->tensor_factor;
          if (c10::isIntegralType(f.scalar_type(), /*includeBool=*/true)) {
            // Exactly, modulo 2^64: through double an int64 above 2^53 would round.
            const c10::Scalar v = f.item();
            r.premulWhole = true;
            r.premulWholeFactor = f.scalar_type() == at::kUInt64
                                      ? v.toUInt64()
                                      : static_cast<uint64_t>(v.toLong());
          }
          r.premulFactor = f.item<double>();
          TORCH_CHECK_VALUE(std::isfinite(r.premulFactor), ctx, ": the PREMUL_SUM factor ",
                            r.premulFactor, " is not finite, which ", scalar,
                            " tensors cannot be scaled by; pass a finite factor");
        }
      } else {
        r.premulFactor = sup->double_factor;
        // An integer holds no NaN or infinity: refused rather than turned into 0.
        TORCH_CHECK_VALUE(floating || std::isfinite(r.premulFactor), ctx,
                          ": the PREMUL_SUM factor ", r.premulFactor, " is not finite, which ",
                          scalar, " tensors cannot be scaled by; pass a finite factor");
      }
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, ctx, ": unsupported reduce op ", static_cast<int>(op.op_),
                        "; use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR or PREMUL_SUM");
  }
  if (floating) {
    TORCH_CHECK_TYPE(r.kind != ReduceKind::BitAnd && r.kind != ReduceKind::BitOr &&
                         r.kind != ReduceKind::BitXor,
                     ctx, ": bitwise reduce op ", r.name, " is not defined for floating dtype ",
                     scalar, "; use an integer or bool tensor, or SUM/MIN/MAX");
  }
  r.fn = kernels::cpuReduceFn(r.dtype, r.kind);
  TORCH_CHECK_TYPE(r.fn != nullptr, ctx, ": reduce op ", r.name, " is not supported for ",
                   scalar);
  return r;
}

at::Tensor reducibleView(const std::string& ctx, const at::Tensor& t, const std::string& name,
                         const c10d::ReduceOp& op) {
  if (!t.defined() || !t.is_complex()) return t;
  const bool sumLike = op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                       op.op_ == c10d::ReduceOp::PREMUL_SUM;
  TORCH_CHECK_TYPE(sumLike, ctx, ": ", name, " is complex (", t.scalar_type(),
                   "), which reduces with SUM, AVG or PREMUL_SUM only; ",
                   reduceOpName(op.op_),
                   " is not defined on complex numbers. Reduce the real and imaginary parts "
                   "(torch.view_as_real) yourself if that is what you mean");
  // A complex PREMUL_SUM factor is refused by makeReduction, for every dtype.
  TORCH_CHECK_VALUE(!t.is_conj(), ctx, ": ", name, " is a conjugate view (its conj bit is "
                    "set), whose memory holds the unconjugated values; call "
                    ".resolve_conj() on it first");
  return at::view_as_real(t);
}

HostImage::HostImage(GroupChannel& ch, const at::Tensor& t, bool copyIn) : user_(t) {
  if (t.is_cpu() && t.is_contiguous()) {
    host_ = t;  // the caller's tensor, which the op's task keeps alive
    return;
  }
  staged_ = true;
  host_ = at::empty(t.sizes(), t.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
  ch.keep(std::make_shared<at::Tensor>(host_), host_.nbytes());
  if (copyIn) host_.copy_(t);
}

void HostImage::copyOut() {
  if (staged_) user_.copy_(host_);
}

} // namespace tdx
