#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/half.h"
#include "kernels/int_scale.h"
#include "kernels/reduce.h"

namespace tdx {

size_t elementSize(DType t) {
  switch (t) {
    case DType::Float64:
    case DType::Int64:
      return 8;
    case DType::Float32:
    case DType::Int32:
      return 4;
    case DType::Float16:
    case DType::BFloat16:
    case DType::Int16:
      return 2;
    case DType::Int8:
    case DType::UInt8:
    case DType::Bool:
      return 1;
  }
  return 0;
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int8: return "int8";
    case DType::UInt8: return "uint8";
    case DType::Int16: return "int16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Bool: return "bool";
  }
  return "?";
}

const char* reduceKindName(ReduceKind k) {
  switch (k) {
    case ReduceKind::Sum: return "SUM";
    case ReduceKind::Product: return "PRODUCT";
    case ReduceKind::Min: return "MIN";
    case ReduceKind::Max: return "MAX";
    case ReduceKind::BitAnd: return "BAND";
    case ReduceKind::BitOr: return "BOR";
    case ReduceKind::BitXor: return "BXOR";
  }
  return "?";
}

bool isFloating(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::Float16 ||
         t == DType::BFloat16;
}

namespace kernels {
namespace {

// Integers add and multiply modulo 2^bits, as torch's own ops do. Done on an unsigned
// type at least as wide as int: signed overflow (and the promotion of 16-bit operands
// to int) would be undefined behaviour that the optimiser may exploit.
template <class T>
using Wrap = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

struct Sum {
  template <class T> static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wrap<T>>(a) + static_cast<Wrap<T>>(b));
    } else {
      return a + b;
    }
  }
};
struct Prod {
  template <class T> static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wrap<T>>(a) * static_cast<Wrap<T>>(b));
    } else {
      return a * b;
    }
  }
};
// NaN wins whichever operand holds it (as torch.minimum/maximum): algorithms reduce
// chunks with the operands in different orders, and a NaN must not survive in some
// elements and vanish in others. `b != b` is false for integers.
struct Min { template <class T> static T apply(T a, T b) { return (b < a || b != b) ? b : a; } };
struct Max { template <class T> static T apply(T a, T b) { return (b > a || b != b) ? b : a; } };
struct BitAnd { template <class T> static T apply(T a, T b) { return a & b; } };
struct BitOr { template <class T> static T apply(T a, T b) { return a | b; } };
struct BitXor { template <class T> static T apply(T a, T b) { return a ^ b; } };

// Plain loops over restrict pointers: the compiler vectorises these at -O3.
template <class T, class Op>
void reduceLoop(void* dstv, const void* srcv, size_t n) {
  T* __restrict__ dst = static_cast<T*>(dstv);
  const T* __restrict__ src = static_cast<const T*>(srcv);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(Op::apply(dst[i], src[i]));
  }
}

// Narrow floats are widened to float per element, reduced, and rounded back, matching
// what torch does for a single fp16/bf16 add.
template <class Op, float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduceNarrow(void* dstv, const void* srcv, size_t n) {
  uint16_t* __restrict__ dst = static_cast<uint16_t*>(dstv);
  const uint16_t* __restrict__ src = static_cast<const uint16_t*>(srcv);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = FromF(Op::apply(ToF(dst[i]), ToF(src[i])));
  }
}

// bool is stored as one byte 0/1. SUM behaves as logical OR and PRODUCT as AND (NCCL's
// mapping), so results stay valid booleans.
template <class Op>
void reduceBool(void* dstv, const void* srcv, size_t n) {
  uint8_t* __restrict__ dst = static_cast<uint8_t*>(dstv);
  const uint8_t* __restrict__ src = static_cast<const uint8_t*>(srcv);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<uint8_t>(Op::apply(dst[i] != 0, src[i] != 0));
  }
}

template <class T>
ReduceFn integerFn(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum: return &reduceLoop<T, Sum>;
    case ReduceKind::Product: return &reduceLoop<T, Prod>;
    case ReduceKind::Min: return &reduceLoop<T, Min>;
    case ReduceKind::Max: return &reduceLoop<T, Max>;
    case ReduceKind::BitAnd: return &reduceLoop<T, BitAnd>;
    case ReduceKind::BitOr: return &reduceLoop<T, BitOr>;
    case ReduceKind::BitXor: return &reduceLoop<T, BitXor>;
  }
  return nullptr;
}

template <class T>
ReduceFn floatFn(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum: return &reduceLoop<T, Sum>;
    case ReduceKind::Product: return &reduceLoop<T, Prod>;
    case ReduceKind::Min: return &reduceLoop<T, Min>;
    case ReduceKind::Max: return &reduceLoop<T, Max>;
    default: return nullptr;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
ReduceFn narrowFn(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum: return &reduceNarrow<Sum, ToF, FromF>;
    case ReduceKind::Product: return &reduceNarrow<Prod, ToF, FromF>;
    case ReduceKind::Min: return &reduceNarrow<Min, ToF, FromF>;
    case ReduceKind::Max: return &reduceNarrow<Max, ToF, FromF>;
    default: return nullptr;
  }
}

ReduceFn boolFn(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum:
    case ReduceKind::Max:
    case ReduceKind::BitOr:
      return &reduceBool<BitOr>;
    case ReduceKind::Product:
    case ReduceKind::Min:
    case ReduceKind::BitAnd:
      return &reduceBool<BitAnd>;
    case ReduceKind::BitXor:
      return &reduceBool<BitXor>;
  }
  return nullptr;
}

// x * k modulo 2^64, then narrowed: exact modulo 2^bits of T.
template <class T>
void scaleWholeLoop(void* dstv, const void* srcv, size_t n, uint64_t k) {
  T* dst = static_cast<T*>(dstv);
  const T* src = static_cast<const T*>(srcv);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(static_cast<uint64_t>(static_cast<int64_t>(src[i])) * k);
  }
}

template <class T>
void scaleLoop(void* dstv, const void* srcv, size_t n, double f) {
  T* dst = static_cast<T*>(dstv);
  const T* src = static_cast<const T*>(srcv);
  if constexpr (std::is_integral_v<T>) {
    // A whole factor multiplies exactly (modulo 2^bits): through double, int64 values
    // above 2^53 would be rounded.
    if (f == std::trunc(f)) {
      // f modulo 2^64: x * k is then exact modulo 2^64
      return scaleWholeLoop<T>(dstv, srcv, n, wrapToUint64(f));
    }
    for (size_t i = 0; i < n; ++i) {
      dst[i] = static_cast<T>(wrapToUint64(static_cast<double>(src[i]) * f));
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * f);
}

template <class T>
void divideLoop(void* bufv, size_t n, int64_t d) {
  T* buf = static_cast<T*>(bufv);
  if constexpr (std::is_integral_v<T>) {
    // Divided as int64: the group size need not fit T (256 ranks is 0 as a uint8).
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(static_cast<int64_t>(buf[i]) / d);
  } else if ((d & (d - 1)) == 0) {
    // A power of two has an exact reciprocal, and the product rounds as the quotient
    // does: the same bits, at the cost of a multiply (a vector divide takes several
    // times as long, and AVG divides every element of the result).
    const T inverse = T(1) / static_cast<T>(d);
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] * inverse);
  } else {
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] / static_cast<T>(d));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void scaleNarrow(void* dstv, const void* srcv, size_t n, double f) {
  uint16_t* dst = static_cast<uint16_t*>(dstv);
  const uint16_t* src = static_cast<const uint16_t*>(srcv);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = FromF(static_cast<float>(static_cast<double>(ToF(src[i])) * f));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void divideNarrow(void* bufv, size_t n, int64_t d) {
  uint16_t* buf = static_cast<uint16_t*>(bufv);
  if ((d & (d - 1)) == 0) {  // an exact reciprocal: the same bits (see divideLoop)
    const double inverse = 1.0 / static_cast<double>(d);
    for (size_t i = 0; i < n; ++i) {
      buf[i] = FromF(static_cast<float>(static_cast<double>(ToF(buf[i])) * inverse));
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    buf[i] = FromF(static_cast<float>(static_cast<double>(ToF(buf[i])) / static_cast<double>(d)));
  }
}

} // namespace

ReduceFn cpuReduceFn(DType dtype, ReduceKind op) {
  switch (dtype) {
    case DType::Float32: return floatFn<float>(op);
    case DType::Float64: return floatFn<double>(op);
    case DType::Float16: return narrowFn<halfToFloat, floatToHalf>(op);
    case DType::BFloat16: return narrowFn<bf16ToFloat, floatToBf16>(op);
    case DType::Int8: return integerFn<int8_t>(op);
    case DType::UInt8: return integerFn<uint8_t>(op);
    case DType::Int16: return integerFn<int16_t>(op);
    case DType::Int32: return integerFn<int32_t>(op);
    case DType::Int64: return integerFn<int64_t>(op);
    case DType::Bool: return boolFn(op);
  }
  return nullptr;
}

void cpuScale(void* dst, const void* src, size_t count, DType dtype, double factor) {
  switch (dtype) {
    case DType::Float32: return scaleLoop<float>(dst, src, count, factor);
    case DType::Float64: return scaleLoop<double>(dst, src, count, factor);
    case DType::Float16: return scaleNarrow<halfToFloat, floatToHalf>(dst, src, count, factor);
    case DType::BFloat16: return scaleNarrow<bf16ToFloat, floatToBf16>(dst, src, count, factor);
    case DType::Int8: return scaleLoop<int8_t>(dst, src, count, factor);
    case DType::UInt8: return scaleLoop<uint8_t>(dst, src, count, factor);
    case DType::Int16: return scaleLoop<int16_t>(dst, src, count, factor);
    case DType::Int32: return scaleLoop<int32_t>(dst, src, count, factor);
    case DType::Int64: return scaleLoop<int64_t>(dst, src, count, factor);
    case DType::Bool:
      throw std::invalid_argument("cannot scale a bool tensor");
  }
}

void cpuScaleWhole(void* dst, const void* src, size_t count, DType dtype, uint64_t k) {
  switch (dtype) {
    case DType::Int8: return scaleWholeLoop<int8_t>(dst, src, count, k);
    case DType::UInt8: return scaleWholeLoop<uint8_t>(dst, src, count, k);
    case DType::Int16: return scaleWholeLoop<int16_t>(dst, src, count, k);
    case DType::Int32: return scaleWholeLoop<int32_t>(dst, src, count, k);
    case DType::Int64: return scaleWholeLoop<int64_t>(dst, src, count, k);
    default:
      throw std::invalid_argument("an exact whole factor scales integer tensors only");
  }
}

namespace {

void scaleBy(const Load& l, void* dst, const void* src, size_t count) {
  if (l.exactWhole) {
    cpuScaleWhole(dst, src, count, l.dtype, l.wholeFactor);
  } else {
    cpuScale(dst, src, count, l.dtype, l.factor);
  }
}

} // namespace

void Load::operator()(void* dst, const void* src, size_t bytes) const {
  if (scales) {
    scaleBy(*this, dst, src, bytes / elementSize(dtype));
  } else if (dst != src && bytes > 0) {
    std::memmove(dst, src, bytes);
  }
}

void Load::finish(void* buf, size_t bytes) const {
  if (divisor > 1 && bytes > 0) cpuDivide(buf, bytes / elementSize(dtype), dtype, divisor);
}

void Load::reduce(void* dst, const void* src, size_t bytes, ReduceFn fn) const {
  const size_t elem = elementSize(dtype);  // the op's dtype
  if (!scales) {
    fn(dst, src, bytes / elem);
    return;
  }
  alignas(64) char scaled[8192];
  const size_t step = sizeof(scaled) / elem * elem;
  for (size_t off = 0; off < bytes; off += step) {
    const size_t n = std::min(step, bytes - off);
    scaleBy(*this, scaled, static_cast<const char*>(src) + off, n / elem);
    fn(static_cast<char*>(dst) + off, scaled, n / elem);
  }
}

void cpuDivide(void* buf, size_t count, DType dtype, int64_t divisor) {
  switch (dtype) {
    case DType::Float32: return divideLoop<float>(buf, count, divisor);
    case DType::Float64: return divideLoop<double>(buf, count, divisor);
    case DType::Float16: return divideNarrow<halfToFloat, floatToHalf>(buf, count, divisor);
    case DType::BFloat16: return divideNarrow<bf16ToFloat, floatToBf16>(buf, count, divisor);
    case DType::Int8: return divideLoop<int8_t>(buf, count, divisor);
    case DType::UInt8: return divideLoop<uint8_t>(buf, count, divisor);
    case DType::Int16: return divideLoop<int16_t>(buf, count, divisor);
    case DType::Int32: return divideLoop<int32_t>(buf, count, divisor);
    case DType::Int64: return divideLoop<int64_t>(buf, count, divisor);
    case DType::Bool:
      throw std::invalid_argument("AVG is not defined for bool");
  }
}

} // namespace kernels
} // namespace tdx
