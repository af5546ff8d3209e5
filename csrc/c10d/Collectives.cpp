// The collectives of ProcessGroupTDX: validate on the caller's thread, then queue a body
// that stages tensors into contiguous host images and runs an algorithm on them.
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "c10d/HostCollectives.hpp"
#include "c10d/ProcessGroupTDX.hpp"
#include "c10d/Validation.hpp"

namespace tdx {

using algorithms::Block;
using c10d::OpType;

namespace {

// Why a list of lists must hold one list: c10d passes one tensor per rank per op.
constexpr const char* kOneList = "one list: a rank holds one tensor per op";

Block blockOf(const HostImage& img) {
  return Block{img.data(), img.bytes()};
}

// `input` may be `output` (in place).
void runAllreduce(ProcessGroupTDX& pg, GroupChannel& ch, const at::Tensor& output,
                  const at::Tensor& input, const Reduction& red) {
  const bool inPlace = input.is_same(output);
  HostImage out(ch, output, /*copyIn=*/inPlace);
  HostImage in = inPlace ? out : HostImage(ch, input, /*copyIn=*/true);
  ch.setOpDetail(red.detail.c_str(), detailCode(&red, -1));
  host::allreduce(pg, ch, in.data(), out.data(), out.numel(), output.element_size(), red.fn,
                  red.load(ch.size()));
  out.copyOut();
}

void runAllgatherInto(ProcessGroupTDX& pg, GroupChannel& ch, const at::Tensor& output,
                      const at::Tensor& input) {
  HostImage in(ch, input, true);
  HostImage out(ch, output, false);
  const size_t block = in.bytes();
  std::vector<Block> blocks;
  for (int r = 0; r < ch.size(); ++r) blocks.push_back(Block{out.data() + r * block, block});
  if (block > 0 && blocks[ch.rank()].data != in.data()) {
    std::memmove(blocks[ch.rank()].data, in.data(), block);
  }
  host::allgather(pg, ch, blocks);
  out.copyOut();
}

void runReduceScatterInto(ProcessGroupTDX& pg, GroupChannel& ch, const at::Tensor& output,
                          const at::Tensor& input, const Reduction& red) {
  HostImage in(ch, input, true);
  HostImage out(ch, output, false);
  const size_t block = out.bytes();
  std::vector<Block> blocks;
  for (int r = 0; r < ch.size(); ++r) blocks.push_back(Block{in.data() + r * block, block});
  ch.setOpDetail(red.detail.c_str(), detailCode(&red, -1));
  host::reduceScatter(pg, ch, blocks, out.data(), output.element_size(), red.fn,
                      red.load(ch.size()));
  out.copyOut();
}

// A list op's entry for this rank, which must match its input (all_gather) or output
// (reduce_scatter) where the other entries may differ in size by rank.
void checkOwnEntry(const std::string& ctx, const at::Tensor& entry, const std::string& name,
                   const at::Tensor& ref, const std::string& refName) {
  TORCH_CHECK_VALUE(entry.numel() == ref.numel(), ctx, ": ", name, " (this rank's own entry) has ",
                    entry.numel(), " elements but ", refName, " has ", ref.numel(),
                    "; this rank's entry must have the size of ", refName,
                    " (the other entries, one per rank, may differ)");
}

// Uneven blocks: all_gather and reduce_scatter over lists whose entries differ in size
// by rank (as gloo and NCCL accept). Every rank passes the same list, so every rank pads
// each block to the same largest one, and the algorithms, which move equal blocks, run
// unchanged on the padded images; only the real part of each block is copied out.
bool evenBlocks(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.numel() != ts[0].numel()) return false;
  }
  return true;
}

int64_t widestBlock(const std::vector<at::Tensor>& ts) {
  int64_t widest = 0;
  for (const auto& t : ts) widest = std::max(widest, t.numel());
  return widest;
}

// A flat host tensor for the op's transfers, which the channel keeps alive past the op's
// end where a failed transfer could still touch it.
at::Tensor paddedImage(GroupChannel& ch, const at::Tensor& like, int64_t numel) {
  at::Tensor t = at::empty({numel}, like.options().device(at::kCPU));
  ch.keep(std::make_shared<at::Tensor>(t), t.nbytes());
  return t;
}

// The even all_gather_into_tensor over a padded image, this rank's block of it as input.
void runUnevenAllgather(ProcessGroupTDX& pg, GroupChannel& ch,
                        const std::vector<at::Tensor>& outs, const at::Tensor& input) {
  const int64_t widest = widestBlock(outs);
  at::Tensor padded = paddedImage(ch, input, widest * ch.size());
  at::Tensor mine = padded.narrow(0, widest * ch.rank(), widest);
  mine.narrow(0, 0, input.numel()).copy_(input.reshape(-1));
  runAllgatherInto(pg, ch, padded, mine);
  for (int r = 0; r < ch.size(); ++r) {
    outs[r].copy_(padded.narrow(0, widest * r, outs[r].numel()).view(outs[r].sizes()));
  }
}

// all_gather into a list of tensors, one per rank, even or uneven.
void runAllgatherList(ProcessGroupTDX& pg, GroupChannel& ch, const std::vector<at::Tensor>& outs,
                      const at::Tensor& input) {
  if (!evenBlocks(outs)) {
    runUnevenAllgather(pg, ch, outs, input);
    return;
  }
  HostImage in(ch, input, true);
  std::vector<HostImage> images;
  std::vector<Block> blocks;
  for (const auto& o : outs) images.emplace_back(ch, o, false);
  for (const auto& img : images) blocks.push_back(blockOf(img));
  Block& mine = blocks[ch.rank()];
  if (mine.bytes > 0 && mine.data != in.data()) std::memmove(mine.data, in.data(), mine.bytes);
  host::allgather(pg, ch, blocks);
  for (auto& img : images) img.copyOut();
}

// The even reduce_scatter_tensor over a padded image of the input list.
void runUnevenReduceScatter(ProcessGroupTDX& pg, GroupChannel& ch, const at::Tensor& output,
                            const std::vector<at::Tensor>& ins, const Reduction& red) {
  const int64_t widest = widestBlock(ins);
  at::Tensor padded = paddedImage(ch, output, widest * ch.size());
  for (int r = 0; r < ch.size(); ++r) {
    const int64_t k = ins[r].numel();
    padded.narrow(0, widest * r, k).copy_(ins[r].reshape(-1));
    // Zeros past the block's end: the padding is reduced too, and must stay finite.
    padded.narrow(0, widest * r + k, widest - k).zero_();
  }
  at::Tensor result = paddedImage(ch, output, widest);
  runReduceScatterInto(pg, ch, result, padded, red);
  output.copy_(result.narrow(0, 0, output.numel()).view(output.sizes()));
}

// A coalesced op's limits: the group's timeout, and the collective its entries are.
OpLimits coalescedAs(algorithms::Collective c) {
  OpLimits limits;
  limits.collective = c;
  return limits;
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const std::string ctx = prefix() + " broadcast";
  checkSingle(ctx, tensors);
  checkRank(ctx, opts.rootRank, size_, "root rank");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, ctx, ": rootTensor must be 0 (one tensor per rank)");
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = root == rank_;
  auto host = [this, t, root, isRoot](GroupChannel& ch) {
    HostImage img(ch, t, isRoot);
    host::broadcast(*this, ch, img.data(), img.bytes(), root);
    if (!isRoot) img.copyOut();
  };
  noteFingerprint(root, nullptr);
  return enqueue(OpType::BROADCAST, "broadcast", {t}, {t}, host,
                 [t, root](PeerMemory& pm, GroupChannel& ch, DeviceContext& ctx) {
                   return pm.broadcast(ch, t, root, ctx);
                 },
                 /*writesOutputs=*/!isRoot);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const std::string ctx = prefix() + " all_reduce";
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return sparseAllreduce(ctx, tensors[0], opts);
  }
  checkSingle(ctx, tensors);
  const at::Tensor user = tensors[0];
  at::Tensor t = reducibleView(ctx, user, "the tensor", opts.reduceOp);
  Reduction red = makeReduction(ctx, opts.reduceOp, t.scalar_type(), size_);
  auto host = [this, t, red](GroupChannel& ch) { runAllreduce(*this, ch, t, t, red); };
  noteFingerprint(-1, &red);
  // CUDA: ranks of one host reduce through each other's memory when they all can.
  return enqueue(OpType::ALLREDUCE, "all_reduce", {user}, {user}, host,
                 [t, red](PeerMemory& pm, GroupChannel& ch, DeviceContext& ctx) {
                   return pm.allreduce(ch, t, red, ctx);
                 });
}

// Sparse COO all_reduce, as gloo does it and DDP needs for sparse gradients (an
// nn.Embedding(sparse=True)): every rank's indices and values are gathered, blocks of
// each rank's count of nonzeros, and the sum is their concatenation, coalesced. Three
// all_gathers: the ranks' shapes and counts, then the indices, then the values. Every
// rank concatenates in rank order, so all get the same result, bit for bit. Bytes per
// rank: all ranks' nonzeros (indices and values), which pays where they are few against
// the dense tensor. Missing entries are zeros, so only SUM and its scaled forms apply.
c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::sparseAllreduce(
    const std::string& ctx, const at::Tensor& t, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), ctx, ": the tensor is on ", t.device(),
                    "; tdx handles cpu and cuda tensors. Move it with .cpu() or .cuda()");
  const auto kind = opts.reduceOp.op_;
  if (kind != c10d::ReduceOp::SUM && kind != c10d::ReduceOp::AVG &&
      kind != c10d::ReduceOp::PREMUL_SUM) {
    const char* name = kind == c10d::ReduceOp::MIN       ? "MIN"
                       : kind == c10d::ReduceOp::MAX     ? "MAX"
                       : kind == c10d::ReduceOp::PRODUCT ? "PRODUCT"
                       : kind == c10d::ReduceOp::BAND    ? "BAND"
                       : kind == c10d::ReduceOp::BOR     ? "BOR"
                       : kind == c10d::ReduceOp::BXOR    ? "BXOR"
                                                         : "this reduce op";
    TORCH_CHECK_VALUE(false, ctx, ": a sparse tensor is reduced with SUM, AVG or PREMUL_SUM "
                      "only (its missing entries are zeros, which MIN, MAX, PRODUCT and the "
                      "bitwise ops would take part in); convert it with .to_dense() for ", name);
  }
  const Reduction red = makeReduction(ctx, opts.reduceOp, t.scalar_type(), size_);
  const std::string what = "all_reduce (sparse)";
  auto body = [this, t, red, ctx](GroupChannel& ch) {
    const int n = ch.size();
    // Each rank's duplicates summed first, as its dense twin would hold them: the scale
    // (PREMUL_SUM, float16 AVG) then applies to each rank's share, and the ranks' shares
    // meet in rank order, as gloo adds them. Fewer bytes to send, too.
    at::Tensor local = (t.is_cpu() ? t : t.cpu()).coalesce();
    const int64_t sparseDim = local.sparse_dim();
    at::Tensor indices = local._indices().t().contiguous();  // [nnz, sparse_dim]
    at::Tensor values = local._values().contiguous();
    const kernels::Load load = red.load(n);
    if (load.scales) {  // into a copy: the values may be the caller's
      values = values.clone();
      load(values.data_ptr(), values.data_ptr(), values.nbytes());
    }
    // Shapes and counts, a fixed length whatever the dimensions: [nnz, dtype, sparse_dim,
    // dims, a hash of all sizes, the first kShownDims sizes (zeros past the last)].
    constexpr size_t kShownDims = 8, kHead = 5;
    const auto sizes = local.sizes();
    std::vector<int64_t> meta = {local._nnz(), static_cast<int64_t>(local.scalar_type()),
                                 sparseDim, static_cast<int64_t>(sizes.size()),
                                 static_cast<int64_t>(c10::hash<std::vector<int64_t>>()(
                                     sizes.vec()))};
    for (size_t d = 0; d < kShownDims; ++d) meta.push_back(d < sizes.size() ? sizes[d] : 0);
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor mine = at::tensor(meta, i64);
    std::vector<at::Tensor> metas;
    for (int r = 0; r < n; ++r) metas.push_back(at::empty_like(mine));
    runAllgatherList(*this, ch, metas, mine);
    std::vector<at::Tensor> idx, val;
    for (int r = 0; r < n; ++r) {
      const auto* m = metas[r].data_ptr<int64_t>();
      const bool same = std::equal(meta.begin() + 1, meta.end(), m + 1);
      if (!same) {
        const size_t shown = std::min<size_t>(static_cast<size_t>(m[3]), kShownDims);
        TORCH_CHECK_VALUE(
            false, ctx, ": rank ", r, " passed a sparse tensor ",
            c10::toString(static_cast<at::ScalarType>(m[1])), c10::IntArrayRef(m + kHead, shown),
            static_cast<size_t>(m[3]) > kShownDims ? " (first dims)" : "", " with sparse_dim ",
            m[2], " but this rank's is ", local.scalar_type(), sizes, " with sparse_dim ",
            sparseDim, "; every rank must pass a tensor of the same dtype, size and sparse_dim");
      }
      auto idxShape = std::vector<int64_t>{m[0], sparseDim};
      auto valShape = values.sizes().vec();
      valShape[0] = m[0];
      idx.push_back(at::empty(idxShape, i64));
      val.push_back(at::empty(valShape, values.options()));
    }
    runAllgatherList(*this, ch, idx, indices);
    runAllgatherList(*this, ch, val, values);
    at::Tensor sum = at::sparse_coo_tensor(at::cat(idx).t(), at::cat(val), local.sizes(),
                                           values.options().layout(at::kSparse))
                         .coalesce();
    if (load.divisor > 1) {
      at::Tensor v = sum._values();  // coalesce made it contiguous and its own
      load.finish(v.data_ptr(), v.nbytes());
    }
    t.copy_(t.is_cpu() ? sum : sum.to(t.device()));
  };
  noteFingerprint(-1, &red);
  OpLimits limits;
  limits.collective = algorithms::Collective::Allgather;  // what its messages are
  return enqueue(OpType::ALLREDUCE, what, {t}, {t}, body, nullptr, /*writesOutputs=*/false,
                 limits);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allreduceInto(
    const at::Tensor& output, const at::Tensor& input, const c10d::AllreduceOptions& opts) {
  const std::string ctx = prefix() + " all_reduce_into";
  checkTensor(ctx, input, "input");
  checkSameLayout(ctx, input, output, "output", /*sameNumel=*/true);
  // A contiguous view of the input's own memory (x.view(-1) for x) is the in-place op.
  const bool sameMemory = input.is_contiguous() && output.is_contiguous() &&
                          input.data_ptr() == output.data_ptr();
  if (!sameMemory) checkDisjointOrSame(ctx, output, input);
  at::Tensor out = reducibleView(ctx, output, "the output", opts.reduceOp);
  at::Tensor in = sameMemory ? out : reducibleView(ctx, input, "the input", opts.reduceOp);
  Reduction red = makeReduction(ctx, opts.reduceOp, in.scalar_type(), size_);
  auto host = [this, out, in, red](GroupChannel& ch) { runAllreduce(*this, ch, out, in, red); };
  // Same fingerprint as all_reduce: ranks may mix the two forms of one reduction.
  noteFingerprint(-1, &red);
  // CUDA tensors take the staged host path here; torchdist_ext.all_reduce_into sends them
  // to the in-place op instead, whose peer-memory path works in place.
  return enqueue(OpType::ALLREDUCE, "all_reduce", {output}, {sameMemory ? output : input},
                 host);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const std::string ctx = prefix() + " all_reduce_coalesced";
  std::vector<Reduction> reds;
  std::vector<at::Tensor> ts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensor " + std::to_string(i);
    checkTensor(ctx, tensors[i], name);
    ts.push_back(reducibleView(ctx, tensors[i], name, opts.reduceOp));
    reds.push_back(makeReduction(ctx, opts.reduceOp, ts[i].scalar_type(), size_));
  }
  std::vector<at::Tensor> ins = ts;
  // Tensors that share memory (views of one buffer) are each reduced from the values
  // they had at the call, not from a neighbour's result.
  prepareCoalescedInputs(ctx, ins, ts, /*outputsMayOverlap=*/true);
  if (!reds.empty()) noteFingerprint(-1, &reds[0]);
  // The inputs handed over are the copies made above, kept alive with the op: a send UCX
  // could not cancel after an error may still read them.
  return enqueue(OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors, ins,
                 [this, ts, ins, reds](GroupChannel& ch) {
                   for (size_t i = 0; i < ts.size(); ++i) {
                     runAllreduce(*this, ch, ts[i], ins[i], reds[i]);
                     ch.releaseHeld();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const std::string ctx = prefix() + " reduce";
  checkSingle(ctx, tensors);
  checkRank(ctx, opts.rootRank, size_, "root rank");
  const at::Tensor user = tensors[0];
  at::Tensor t = reducibleView(ctx, user, "the tensor", opts.reduceOp);
  Reduction red = makeReduction(ctx, opts.reduceOp, t.scalar_type(), size_);
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = root == rank_;
  noteFingerprint(root, &red);
  return enqueue(OpType::REDUCE, "reduce", {user}, {user},
                 [this, t, red, root, isRoot](GroupChannel& ch) {
    HostImage img(ch, t, true);
    // The root reduces into its own tensor; other ranks leave theirs untouched.
    ch.setOpDetail(red.detail.c_str(), detailCode(&red, root));
    host::reduce(*this, ch, img.data(), img.data(), img.numel(), t.element_size(), red.fn, root,
                 red.load(ch.size()));
    if (isRoot) img.copyOut();
  }, /*peerAttempt=*/nullptr, /*writesOutputs=*/isRoot);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_gather";
  checkSingle(ctx, inputs);
  checkListSize(ctx, outputs.size(), 1, "the output list of lists",
                kOneList);
  checkListSize(ctx, outputs[0].size(), size_, "the output list");
  at::Tensor input = inputs[0];
  for (int r = 0; r < size_; ++r) {
    checkSameLayout(ctx, input, outputs[0][r], "output tensor " + std::to_string(r), false);
  }
  // Entries may differ in size by rank (uneven blocks); this rank's is its input's.
  checkOwnEntry(ctx, outputs[0][rank_], "output tensor " + std::to_string(rank_), input,
                "the input");
  checkEntriesDisjoint(ctx, outputs[0], "the output list");
  std::vector<at::Tensor> outs = outputs[0];
  // The output list, the same on every rank, is what ranks must agree on.
  OpLimits limits;
  limits.fingerprintInputs = false;
  return enqueue(OpType::ALLGATHER, "all_gather", outs, {input},
                 [this, input, outs](GroupChannel& ch) {
                   runAllgatherList(*this, ch, outs, input);
                 },
                 nullptr, true, limits);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_gather_into_tensor";
  checkTensor(ctx, input, "input");
  checkSameLayout(ctx, input, output, "output", false);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, ctx, ": output has ",
                    output.numel(), " elements but must have input.numel() * world_size = ",
                    input.numel() * size_, "; allocate the output as world_size inputs");
  at::Tensor in = input, out = output;
  auto host = [this, out, in](GroupChannel& ch) { runAllgatherInto(*this, ch, out, in); };
  return enqueue(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {out}, {in}, host,
                 [out, in](PeerMemory& pm, GroupChannel& ch, DeviceContext& ctx) {
                   return pm.allgather(ch, out, in, ctx);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_gather_into_tensor_coalesced";
  checkListSize(ctx, outputs.size(), inputs.size(), "the output list",
                "one per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(ctx, inputs[i], "input " + std::to_string(i));
    checkSameLayout(ctx, inputs[i], outputs[i], "output " + std::to_string(i), false);
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, ctx, ": output ", i,
                      " has ", outputs[i].numel(), " elements but must have ",
                      inputs[i].numel() * size_);
  }
  std::vector<at::Tensor> outs = outputs, ins = inputs;
  prepareCoalescedInputs(ctx, ins, outs, false);
  return enqueue(OpType::COALESCED, "all_gather_into_tensor_coalesced", outs, ins,
                 [this, outs, ins](GroupChannel& ch) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     runAllgatherInto(*this, ch, outs[i], ins[i]);
                     ch.releaseHeld();
                   }
                 },
                 nullptr, true, coalescedAs(algorithms::Collective::Allgather));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_gather_coalesced";
  checkListSize(ctx, outputLists.size(), inputs.size(), "the list of output lists",
                "one per input");
  std::vector<at::Tensor> flatOuts;
  std::vector<size_t> outEntry;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(ctx, inputs[i], "input " + std::to_string(i));
    checkListSize(ctx, outputLists[i].size(), size_, "an output list");
    for (auto& o : outputLists[i]) {
      checkSameLayout(ctx, inputs[i], o, "output of input " + std::to_string(i), true);
      flatOuts.push_back(o);
      outEntry.push_back(i);
    }
    // Within one list, as in all_gather (prepareCoalescedInputs compares one entry's
    // tensors with another's, not those of one list with each other).
    checkEntriesDisjoint(ctx, outputLists[i], "output list " + std::to_string(i));
  }
  auto lists = outputLists;
  std::vector<at::Tensor> ins = inputs;
  prepareCoalescedInputs(ctx, ins, flatOuts, false, outEntry);
  return enqueue(OpType::ALLGATHER_COALESCED, "all_gather_coalesced", flatOuts, ins,
                 [this, lists, ins](GroupChannel& ch) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     HostImage in(ch, ins[i], true);
                     std::vector<HostImage> images;
                     std::vector<Block> blocks;
                     for (const auto& o : lists[i]) images.emplace_back(ch, o, false);
                     for (const auto& img : images) blocks.push_back(blockOf(img));
                     if (in.bytes() > 0) std::memmove(blocks[ch.rank()].data, in.data(), in.bytes());
                     host::allgather(*this, ch, blocks);
                     for (auto& img : images) img.copyOut();
                     ch.releaseHeld();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const std::string ctx = prefix() + " gather";
  checkSingle(ctx, inputs);
  checkRank(ctx, opts.rootRank, size_, "root rank");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor input = inputs[0];
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    checkListSize(ctx, outputs.size(), 1, "the root's output list of lists",
                kOneList);
    checkListSize(ctx, outputs[0].size(), size_, "the root's gather list");
    for (int r = 0; r < size_; ++r) {
      const std::string name = "gather_list[" + std::to_string(r) + "]";
      checkSameLayout(ctx, input, outputs[0][r], name, true);
      // The root's own entry may be its input (gathered in place); another rank's entry
      // is written while the input may still be read.
      if (r != root) checkDisjoint(ctx, outputs[0][r], input, "the input", name);
    }
    checkEntriesDisjoint(ctx, outputs[0], "the gather list");
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), ctx,
                      ": only the root (rank ", root,
                      ") passes a gather list; pass gather_list=None on other ranks");
  }
  noteFingerprint(root, nullptr);
  return enqueue(OpType::GATHER, "gather", outs, {input}, [this, input, outs, root](GroupChannel& ch) {
    HostImage in(ch, input, true);
    std::vector<HostImage> images;
    std::vector<Block> blocks;
    for (const auto& o : outs) images.emplace_back(ch, o, false);
    for (const auto& img : images) blocks.push_back(blockOf(img));
    host::gather(*this, ch, blockOf(in), blocks, root);
    for (auto& img : images) img.copyOut();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::gather_single(
    at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) {
  const std::string ctx = prefix() + " gather_single";
  checkTensor(ctx, input, "input");
  checkRank(ctx, opts.rootRank, size_, "root rank");
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  at::Tensor in = input, out = output;
  // Ranks other than the root receive nothing: torch hands them an empty tensor.
  if (isRoot) {
    checkSameLayout(ctx, input, output, "output", false);
    TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, ctx, ": output has ",
                      output.numel(), " elements but must have input.numel() * world_size = ",
                      input.numel() * size_, "; allocate the output as world_size inputs");
    // In place, the input is the root's block of the output. Copies staged for
    // non-contiguous tensors are read before, and written back after, the op.
    if (input.numel() > 0 && input.is_contiguous() && output.is_contiguous()) {
      const auto overlap = at::get_overlap_status(input, output);
      const char* own = static_cast<const char*>(output.data_ptr()) +
                        root * input.numel() * input.element_size();
      TORCH_CHECK_VALUE(overlap == at::MemOverlapStatus::No ||
                            overlap == at::MemOverlapStatus::TooHard || input.data_ptr() == own,
                        ctx, ": the input shares memory with the output but is not the "
                        "root's block of it, which other ranks' blocks would overwrite; pass "
                        "an input of its own, or gather in place with input = "
                        "output.view(-1).chunk(world_size)[", root, "]");
    }
  }
  noteFingerprint(root, nullptr);
  std::vector<at::Tensor> outs;
  if (isRoot) outs.push_back(out);
  return enqueue(OpType::GATHER, "gather_single", outs, {in},
                 [this, in, out, root, isRoot](GroupChannel& ch) {
                   HostImage inImg(ch, in, true);
                   HostImage outImg;
                   std::vector<Block> blocks;
                   if (isRoot) {
                     outImg = HostImage(ch, out, false);
                     for (int r = 0; r < ch.size(); ++r) {
                       blocks.push_back(Block{outImg.data() + r * inImg.bytes(), inImg.bytes()});
                     }
                   }
                   host::gather(*this, ch, blockOf(inImg), blocks, root);
                   if (isRoot) outImg.copyOut();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const std::string ctx = prefix() + " scatter";
  checkSingle(ctx, outputs);
  checkRank(ctx, opts.rootRank, size_, "root rank");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor output = outputs[0];
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    checkListSize(ctx, inputs.size(), 1, "the root's input list of lists",
                kOneList);
    checkListSize(ctx, inputs[0].size(), size_, "the root's scatter list");
    for (int r = 0; r < size_; ++r) {
      const std::string name = "scatter_list[" + std::to_string(r) + "]";
      checkSameLayout(ctx, output, inputs[0][r], name, true, "the output");
      // The root's own entry may be its output (scattered in place); another rank's
      // entry is still to be sent when the output is written.
      if (r != root) checkDisjoint(ctx, output, inputs[0][r], name);
    }
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), ctx,
                      ": only the root (rank ", root,
                      ") passes a scatter list; pass scatter_list=None on other ranks");
  }
  noteFingerprint(root, nullptr);
  return enqueue(OpType::SCATTER, "scatter", {output}, ins, [this, output, ins, root](GroupChannel& ch) {
    HostImage out(ch, output, false);
    std::vector<HostImage> images;
    std::vector<Block> blocks;
    for (const auto& i : ins) images.emplace_back(ch, i, true);
    for (const auto& img : images) blocks.push_back(blockOf(img));
    host::scatter(*this, ch, blocks, blockOf(out), root);
    out.copyOut();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const std::string ctx = prefix() + " reduce_scatter";
  checkSingle(ctx, outputs);
  checkListSize(ctx, inputs.size(), 1, "the input list of lists",
                kOneList);
  checkListSize(ctx, inputs[0].size(), size_, "the input list");
  at::Tensor output = outputs[0];
  for (int r = 0; r < size_; ++r) {
    const std::string name = "input_list[" + std::to_string(r) + "]";
    checkSameLayout(ctx, output, inputs[0][r], name, false, "the output");
    // Blocks may differ in size by rank (uneven blocks); this rank's is its output's.
    if (r == rank_) checkOwnEntry(ctx, inputs[0][r], name, output, "the output");
    // The output may be this rank's own input (in place), never part of another's: that
    // one is still read after the output is written.
    if (r == rank_) {
      // Its own entry, also as a view of another shape (same memory, contiguous).
      const at::Tensor& own = inputs[0][r];
      const bool sameMemory = output.is_contiguous() && own.is_contiguous() &&
                              output.data_ptr() == own.data_ptr();
      if (!sameMemory && output.numel() > 0) checkDisjointOrSame(ctx, output, own);
    } else {
      checkDisjoint(ctx, output, inputs[0][r], name);
    }
  }
  at::Tensor out = reducibleView(ctx, output, "the output", opts.reduceOp);
  std::vector<at::Tensor> ins;
  for (int r = 0; r < size_; ++r) {
    ins.push_back(reducibleView(ctx, inputs[0][r], "input_list[" + std::to_string(r) + "]",
                                opts.reduceOp));
  }
  Reduction red = makeReduction(ctx, opts.reduceOp, out.scalar_type(), size_);
  noteFingerprint(-1, &red);
  // The input list, the same on every rank, is what ranks must agree on.
  OpLimits limits;
  limits.fingerprintOutputs = false;
  return enqueue(OpType::REDUCE_SCATTER, "reduce_scatter", {output}, inputs[0],
                 [this, output = out, ins, red](GroupChannel& ch) {
                   if (!evenBlocks(ins)) {
                     runUnevenReduceScatter(*this, ch, output, ins, red);
                     return;
                   }
                   std::vector<HostImage> images;
                   std::vector<Block> blocks;
                   for (const auto& i : ins) images.emplace_back(ch, i, true);
                   for (const auto& img : images) blocks.push_back(blockOf(img));
                   HostImage out(ch, output, false);
                   ch.setOpDetail(red.detail.c_str(), detailCode(&red, -1));
                   host::reduceScatter(*this, ch, blocks, out.data(), output.element_size(),
                                       red.fn, red.load(ch.size()));
                   out.copyOut();
                 },
                 nullptr, true, limits);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const std::string ctx = prefix() + " reduce_scatter_tensor";
  checkTensor(ctx, output, "output");
  checkSameLayout(ctx, output, input, "input", false, "the output");
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, ctx, ": input has ", input.numel(),
                    " elements but must have output.numel() * world_size = ",
                    output.numel() * size_);
  checkOwnBlockOrDisjoint(ctx, output, input, rank_);
  at::Tensor out = reducibleView(ctx, output, "the output", opts.reduceOp);
  at::Tensor in = reducibleView(ctx, input, "the input", opts.reduceOp);
  Reduction red = makeReduction(ctx, opts.reduceOp, out.scalar_type(), size_);
  auto host = [this, out, in, red](GroupChannel& ch) {
    runReduceScatterInto(*this, ch, out, in, red);
  };
  noteFingerprint(-1, &red);
  return enqueue(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output}, {input}, host,
                 [out, in, red](PeerMemory& pm, GroupChannel& ch, DeviceContext& ctx) {
                   return pm.reduceScatter(ch, out, in, red, ctx);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const std::string ctx = prefix() + " reduce_scatter_tensor_coalesced";
  checkListSize(ctx, outputs.size(), inputs.size(), "the output list",
                "one per input");
  std::vector<Reduction> reds;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(ctx, outputs[i], "output " + std::to_string(i));
    checkSameLayout(ctx, outputs[i], inputs[i], "input " + std::to_string(i), false,
                    "output " + std::to_string(i));
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, ctx, ": input ", i,
                      " has ", inputs[i].numel(), " elements but must have ",
                      outputs[i].numel() * size_);
    checkOwnBlockOrDisjoint(ctx, outputs[i], inputs[i], rank_);
  }
  std::vector<at::Tensor> outs, ins;
  for (size_t i = 0; i < inputs.size(); ++i) {
    outs.push_back(reducibleView(ctx, outputs[i], "output " + std::to_string(i), opts.reduceOp));
    ins.push_back(reducibleView(ctx, inputs[i], "input " + std::to_string(i), opts.reduceOp));
    reds.push_back(makeReduction(ctx, opts.reduceOp, outs[i].scalar_type(), size_));
  }
  prepareCoalescedInputs(ctx, ins, outs, false);
  if (!reds.empty()) noteFingerprint(-1, &reds[0]);
  return enqueue(OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs, ins,
                 [this, outs, ins, reds](GroupChannel& ch) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     runReduceScatterInto(*this, ch, outs[i], ins[i], reds[i]);
                     ch.releaseHeld();
                   }
                 },
                 nullptr, true, coalescedAs(algorithms::Collective::ReduceScatter));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_to_all_single";
  checkTensor(ctx, input, "input");
  checkSameLayout(ctx, input, output, "output", false);
  TORCH_CHECK_VALUE(input.dim() >= 1 && output.dim() >= 1, ctx,
                    ": input and output need at least one dimension to split along dim 0");
  auto resolve = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* name) {
    std::vector<int64_t> rows;
    if (splits.empty()) {
      TORCH_CHECK_VALUE(t.size(0) % size_ == 0, ctx, ": ", name, " has ", t.size(0),
                        " rows, which world_size ", size_,
                        " does not divide; pass explicit split sizes");
      rows.assign(size_, t.size(0) / size_);
    } else {
      checkListSize(ctx, splits.size(), size_, name);
      int64_t sum = 0;
      for (int64_t s : splits) {
        TORCH_CHECK_VALUE(s >= 0, ctx, ": ", name, " has a negative split size ", s);
        // Checked before adding: a sum past int64's range would wrap and could match.
        TORCH_CHECK_VALUE(s <= t.size(0) - sum, ctx, ": ", name, " sum to more than the ",
                          t.size(0), " rows the tensor has along dim 0");
        sum += s;
      }
      TORCH_CHECK_VALUE(sum == t.size(0), ctx, ": ", name, " sum to ", sum, " but the tensor has ",
                        t.size(0), " rows along dim 0");
      rows = splits;
    }
    return rows;
  };
  std::vector<int64_t> inRows = resolve(input, inputSplits, "input split sizes");
  std::vector<int64_t> outRows = resolve(output, outputSplits, "output split sizes");
  const int64_t inRow = input.size(0) ? input.numel() / input.size(0) : 0;
  const int64_t outRow = output.size(0) ? output.numel() / output.size(0) : 0;
  TORCH_CHECK_VALUE(input.size(0) == 0 || output.size(0) == 0 || inRow == outRow, ctx,
                    ": input rows have ", inRow, " elements but output rows have ", outRow,
                    "; all dims but the first must match");
  // The block a rank sends itself is copied locally, never checked by a peer: sizes
  // that differ would copy past the output's block (or leave it unwritten).
  TORCH_CHECK_VALUE(inRows[rank_] == outRows[rank_], ctx, ": rank ", rank_, " sends ",
                    inRows[rank_], " rows to itself (input split sizes[", rank_,
                    "]) but expects ", outRows[rank_], " (output split sizes[", rank_,
                    "]); make them equal");
  const int64_t row = std::max(inRow, outRow);
  at::Tensor in = input, out = output;
  return enqueue(OpType::ALLTOALL_BASE, "all_to_all_single", {out}, {in},
                 [this, in, out, inRows, outRows, row](GroupChannel& ch) {
                   HostImage inImg(ch, in, true);
                   HostImage outImg(ch, out, false);
                   at::Tensor src = inImg.host();
                   // In place (output aliases input): send from a private copy.
                   if (inImg.bytes() > 0 && outImg.data() < inImg.data() + inImg.bytes() &&
                       inImg.data() < outImg.data() + outImg.bytes()) {
                     src = src.clone();
                     ch.keep(std::make_shared<at::Tensor>(src), src.nbytes());  // sends read it
                   }
                   const size_t rowBytes = row * in.element_size();
                   std::vector<Block> sends, recvs;
                   size_t inOff = 0, outOff = 0;
                   for (int r = 0; r < ch.size(); ++r) {
                     sends.push_back(Block{static_cast<char*>(src.data_ptr()) + inOff, inRows[r] * rowBytes});
                     recvs.push_back(Block{outImg.data() + outOff, outRows[r] * rowBytes});
                     inOff += inRows[r] * rowBytes;
                     outOff += outRows[r] * rowBytes;
                   }
                   host::alltoall(*this, ch, sends, recvs);
                   outImg.copyOut();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& /*opts*/) {
  const std::string ctx = prefix() + " all_to_all";
  checkListSize(ctx, inputs.size(), size_, "the input list");
  checkListSize(ctx, outputs.size(), size_, "the output list");
  checkTensor(ctx, inputs[0], "input 0");
  for (int r = 0; r < size_; ++r) {
    checkSameLayout(ctx, inputs[0], inputs[r], "input " + std::to_string(r), false, "input 0");
    checkSameLayout(ctx, inputs[0], outputs[r], "output " + std::to_string(r), false, "input 0");
  }
  // As in all_to_all_single: this rank's own block is copied, never checked by a peer.
  TORCH_CHECK_VALUE(inputs[rank_].numel() == outputs[rank_].numel(), ctx, ": rank ", rank_,
                    "'s input ", rank_, " has ", inputs[rank_].numel(), " elements but its output ",
                    rank_, " has ", outputs[rank_].numel(), "; the block a rank sends itself "
                    "must fit its own output exactly");
  // Two blocks written into the same memory would leave whichever landed last, which
  // differs between ranks and algorithms.
  checkEntriesDisjoint(ctx, outputs, "the output list");
  std::vector<at::Tensor> outs = outputs, ins = inputs;
  return enqueue(OpType::ALLTOALL, "all_to_all", outs, ins, [this, outs, ins](GroupChannel& ch) {
    std::vector<HostImage> inImgs, outImgs;
    std::vector<at::Tensor> srcs;
    std::vector<Block> sends, recvs;
    for (const auto& t : ins) inImgs.emplace_back(ch, t, true);
    for (const auto& t : outs) outImgs.emplace_back(ch, t, false);
    for (int r = 0; r < ch.size(); ++r) {
      // Outputs may alias inputs; send from private copies when they do.
      at::Tensor src = inImgs[r].host();
      for (const auto& o : outImgs) {
        if (src.numel() > 0 && o.data() < inImgs[r].data() + inImgs[r].bytes() &&
            inImgs[r].data() < o.data() + o.bytes()) {
          src = src.clone();
          ch.keep(std::make_shared<at::Tensor>(src), src.nbytes());  // sends read it
          break;
        }
      }
      srcs.push_back(src);
      sends.push_back(Block{static_cast<char*>(src.data_ptr()), inImgs[r].bytes()});
      recvs.push_back(blockOf(outImgs[r]));
    }
    host::alltoall(*this, ch, sends, recvs);
    for (auto& img : outImgs) img.copyOut();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::barrier(const c10d::BarrierOptions& opts) {
  std::vector<at::Tensor> none;
  if (opts.device.has_value() && opts.device->type() != c10::DeviceType::CPU) {
    // A device barrier also orders the caller's stream (as NCCL's does): a one-byte
    // tensor on that device makes the worker wait for the stream before the barrier.
    none.push_back(at::empty({1}, at::TensorOptions().dtype(at::kByte).device(*opts.device)));
  }
  return enqueue(OpType::BARRIER, "barrier", {}, none,
                 [this](GroupChannel& ch) { host::barrier(*this, ch); });
}

void ProcessGroupTDX::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  OpLimits limits;
  limits.timeout = opts.timeout == c10d::kUnsetTimeout ? timeout() : opts.timeout;
  TORCH_CHECK_VALUE(limits.timeout.count() > 0, prefix(),
                    " monitored_barrier: the timeout must be positive, got ",
                    limits.timeout.count(), " ms");
  limits.fingerprinted = false;
  const std::chrono::milliseconds limit = limits.timeout;
  if (rank_ != 0) {
    // The other ranks wait for rank 0's release a grace longer than rank 0 waits for
    // them, so a rank 0 that reached the barrier a little later still releases them or
    // tells them which rank it missed; and they tell the group nothing themselves.
    limits.timeout += std::min(limit, std::chrono::milliseconds(5000));
    limits.tellsPeers = false;
  }
  auto work = enqueue(OpType::BARRIER, "monitored_barrier", {}, {},
                      [waitAllRanks, limit](GroupChannel& ch) {
                        host::monitoredBarrier(ch, waitAllRanks, limit);
                      },
                      nullptr, true, limits);
  work->wait();
}

} // namespace tdx
