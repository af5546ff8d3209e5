// CPU reduction kernels: dst[i] = dst[i] (op) src[i] for every ReduceKind x DType.
// Arithmetic only: no communication, no allocation. Type-erased behind a function
// pointer so algorithms stay free of templates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace tdx {
namespace kernels {

using ReduceFn = void (*)(void* dst, const void* src, size_t count);

// nullptr when the pair is meaningless (bitwise ops on floating types).
ReduceFn cpuReduceFn(DType dtype, ReduceKind op);

// dst[i] = src[i] * factor. Integers multiply exactly by a whole factor (modulo
// 2^bits); by any other factor in double, truncated toward zero and wrapped modulo
// 2^bits (kernels/int_scale.h). dst may be src.
void cpuScale(void* dst, const void* src, size_t count, DType dtype, double factor);
// dst[i] = src[i] * k modulo 2^bits, for integer dtypes: a whole factor that came as an
// integer, which a double need not hold exactly (an int64 above 2^53).
void cpuScaleWhole(void* dst, const void* src, size_t count, DType dtype, uint64_t k);

// How a rank's own contribution enters a reduction: copied as it is, or multiplied by
// `factor` on the way (PREMUL_SUM, float16 AVG). Algorithms call it where they first
// copy their input anyway, so the scaling costs no pass over memory of its own.
struct Load {
  DType dtype = DType::Float32;
  double factor = 1.0;
  bool scales = false;
  // Integer dtypes: the factor is the whole number `wholeFactor` (modulo 2^64), used
  // instead of `factor`, which may have rounded it.
  bool exactWhole = false;
  uint64_t wholeFactor = 0;
  // dst = src (x factor), `bytes` of whole elements. dst may be src, or must not overlap
  // it; an unscaled load onto itself does nothing.
  void operator()(void* dst, const void* src, size_t bytes) const;
  // dst = dst (reduce) src (x factor), `bytes` of whole elements, without a pass of its
  // own: src is scaled a few KiB at a time into a buffer that stays in L1. The result is
  // the same as scaling all of src first and then reducing.
  void reduce(void* dst, const void* src, size_t bytes, ReduceFn fn) const;

  // AVG: the finished sum divided by `divisor` (cpuDivide), once, where an algorithm
  // has a block of it final and still in cache, or over the result after the op.
  int64_t divisor = 1;
  void finish(void* buf, size_t bytes) const;
};

// buf[i] = buf[i] / divisor; integer types use truncating division (as NCCL's AVG does).
void cpuDivide(void* buf, size_t count, DType dtype, int64_t divisor);

} // namespace kernels
} // namespace tdx
