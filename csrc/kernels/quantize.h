// CPU codecs of the compressed all_reduce (torchdist_ext.compression): rows of float32 or
// float64 values to the bytes that travel, and back, in one pass per block instead of the
// several passes (abs, max, divide, round, clamp, cast, multiply) that separate tensor
// ops make. Arithmetic only: no communication, no allocation.
//
// Payload row layouts (each row at `payload + r * stride`; scales are stored unaligned):
//   int8: `length` int8 values, then length/block scales (max|x| / 127 per block);
//   sign: length/8 bytes of signs (element i is bit i%8 of byte i/8, set when x >= 0),
//         then length/block scales (mean |x| over the block's first `valid` elements).
// A block holding an infinity or a NaN gets a NaN scale, so it decodes to NaN; its `lost`
// (x minus what the receiver will decode, for error feedback) is 0. Int8's values are
// round-half-even(x / scale) clamped to +-127, exactly as torch.round would give them.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace tdx {
namespace kernels {

enum class Codec { Int8, Sign };

// `x`: `rows` rows of `length` elements of `dtype` (Float32 or Float64), contiguous;
// `length` is a multiple of `block` (and, for Sign, of 8). `valid[r]`: how many of row
// r's elements are the tensor's (Sign's mean skips the padding after them). `lost`
// (nullable) receives rows x length elements.
void cpuEncode(Codec codec, const void* x, int64_t rows, int64_t length, int64_t block,
               const int64_t* valid, DType dtype, uint8_t* payload, int64_t stride,
               void* lost);

// Decodes `rows` payload rows into `out`: rows x length elements, or, with `sumRows`, one
// row holding their sum, added in row order.
void cpuDecode(Codec codec, const uint8_t* payload, int64_t stride, int64_t rows,
               int64_t length, int64_t block, DType dtype, void* out, bool sumRows);

} // namespace kernels
} // namespace tdx
