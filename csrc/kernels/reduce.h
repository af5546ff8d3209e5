// CPU reduction kernels: dst[i] = dst[i] (op) src[i] for every ReduceKind x DType.
// Arithmetic only: no communication, no allocation. Type-erased behind a function
// pointer so algorithms stay free of templates.
#pragma once

#include <cstddef>

#include "common/types.h"

namespace tdx {
namespace kernels {

using ReduceFn = void (*)(void* dst, const void* src, size_t count);

// nullptr when the pair is meaningless (bitwise ops on floating types).
ReduceFn cpuReduceFn(DType dtype, ReduceKind op);

// buf[i] = buf[i] * factor (floating types; integers are multiplied and truncated).
void cpuScale(void* buf, size_t count, DType dtype, double factor);

// buf[i] = buf[i] / divisor; integer types use truncating division (as NCCL's AVG does).
void cpuDivide(void* buf, size_t count, DType dtype, int64_t divisor);

} // namespace kernels
} // namespace tdx
