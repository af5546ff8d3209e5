// CUDA reduction kernels: arithmetic only, on an explicit stream, no communication and no
// allocation. The same (dtype, kind) pairs as the CPU kernels in reduce.h, and the same
// meaning; results are tested against them.
//
// Declared without CUDA headers so callers that never see a GPU (algorithms, the c10d
// adapter in a CPU-only build) can include this file. A stream is passed as void*
// (a cudaStream_t).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace tdx {
namespace kernels {

// The most buffers one multi-reduce reads or writes: one per rank of a same-host group.
constexpr int kMaxMultiBuffers = 16;

// out_j[i] = finish( reduce_k ( start(in_k[i]) ) ) for every output j, every i < count.
//   start: x * premulFactor when `premul` (PREMUL_SUM, float16 AVG), else x.
//   finish: / divisor when divisor > 1 (AVG; integers truncate toward zero).
// Floating results are accumulated in float (half, bfloat16, float32) or double.
// Outputs may alias inputs element for element (in place). Any alignment is accepted;
// 16-byte aligned buffers take the vectorised path.
struct MultiReduceArgs {
  const void* inputs[kMaxMultiBuffers] = {};
  int numInputs = 0;
  void* outputs[kMaxMultiBuffers] = {};
  int numOutputs = 0;
  size_t count = 0;
  DType dtype = DType::Float32;
  ReduceKind kind = ReduceKind::Sum;
  bool premul = false;
  double premulFactor = 1.0;
  // Integer dtypes: the factor is the whole number `wholeFactor` (modulo 2^64), used
  // instead of premulFactor, which may have rounded it.
  bool exactWhole = false;
  uint64_t wholeFactor = 0;
  int64_t divisor = 1;
};

// True when `kind` is defined on `dtype` (bitwise kinds are not defined on floats).
bool cudaReduceSupported(DType dtype, ReduceKind kind);

// Enqueues the multi-reduce on `stream`; throws std::invalid_argument for an unsupported
// pair or too many buffers, std::runtime_error when the launch fails.
void cudaMultiReduce(const MultiReduceArgs& args, void* stream);

// dst[i] = dst[i] (kind) src[i] on device memory: the CPU ReduceFn's contract plus a stream.
void cudaReduce(void* dst, const void* src, size_t count, DType dtype, ReduceKind kind,
                void* stream);

} // namespace kernels
} // namespace tdx
