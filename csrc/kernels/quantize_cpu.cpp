// CPU block codecs; see quantize.h for the layouts.
#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace tdx {
namespace kernels {

namespace {

// Adding and subtracting 1.5 * 2^(mantissa bits) rounds |v| < 2^(mantissa bits - 1) to
// the nearest integer, ties to even, in the current (default) rounding mode: what
// std::nearbyint and torch.round give, but in two additions the compiler can vectorize
// (it may not fold them away: without -ffast-math, floating-point addition is not
// reassociated). Int8's quotients are within +-127 (and a hair).
template <typename T>
constexpr T roundMagic() {
  return T(1.5) * T(uint64_t{1} << (std::numeric_limits<T>::digits - 1));
}

template <typename T>
T loadScale(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void storeScale(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// max |x| over a block, and whether it held a NaN. In kLanes independent lanes, which the
// compiler turns into vector max instructions: one running max in program order is a
// chain it may not reorder (a NaN would make the order matter; here NaN is tracked on
// its own, and the max of the other values does not depend on the order).
constexpr int kLanes = 8;

template <typename T>
void blockMax(const T* x, int64_t block, T& amax, int& nan) {
  int64_t i = 0;
  if (block >= kLanes) {
    T lane[kLanes] = {};
    int bad[kLanes] = {};
    for (; i + kLanes <= block; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const T a = std::abs(x[i + j]);
        lane[j] = a > lane[j] ? a : lane[j];
        bad[j] |= a != a;
      }
    }
    for (int j = 0; j < kLanes; ++j) {
      amax = lane[j] > amax ? lane[j] : amax;
      nan |= bad[j];
    }
  }
  for (; i < block; ++i) {
    const T a = std::abs(x[i]);
    amax = a > amax ? a : amax;
    nan |= a != a;
  }
}

template <typename T>
void encodeInt8Row(const T* x, int64_t length, int64_t block, uint8_t* out, T* lost) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  uint8_t* scales = out + length;
  const T magic = roundMagic<T>();
  for (int64_t b = 0; b * block < length; ++b) {
    const T* xb = x + b * block;
    int8_t* qb = q + b * block;
    T amax = 0;
    int nan = 0;
    blockMax(xb, block, amax, nan);
    const bool finite = !nan && amax <= std::numeric_limits<T>::max();
    const T scale = amax / T(127);
    if (finite && scale > 0) {
      for (int64_t i = 0; i < block; ++i) {
        T v = (xb[i] / scale + magic) - magic;
        v = std::min(std::max(v, T(-127)), T(127));
        qb[i] = static_cast<int8_t>(v);
        if (lost != nullptr) {
          lost[b * block + i] = xb[i] - v * scale;
        }
      }
    } else {
      // All zeros (the scale is 0 and so is every value), or not finite (nothing is
      // kept: the block decodes to NaN).
      std::memset(qb, 0, static_cast<size_t>(block));
      if (lost != nullptr) {
        std::fill(lost + b * block, lost + (b + 1) * block, T(0));
      }
    }
    storeScale<T>(scales + b * sizeof(T),
                  finite ? scale : std::numeric_limits<T>::quiet_NaN());
  }
}

template <typename T>
void encodeSignRow(const T* x, int64_t length, int64_t block, int64_t valid, uint8_t* out,
                   T* lost) {
  uint8_t* scales = out + length / 8;
  for (int64_t b = 0; b * block < length; ++b) {
    const T* xb = x + b * block;
    double sum = 0;
    for (int64_t i = 0; i < block; ++i) {
      sum += std::abs(static_cast<double>(xb[i]));
    }
    const int64_t count = std::clamp<int64_t>(valid - b * block, 1, block);
    const bool finite = std::isfinite(sum);
    const T scale = finite ? static_cast<T>(sum / static_cast<double>(count))
                           : std::numeric_limits<T>::quiet_NaN();
    storeScale<T>(scales + b * sizeof(T), scale);
    if (lost != nullptr) {
      T* lb = lost + b * block;
      if (finite) {
        for (int64_t i = 0; i < block; ++i) {
          lb[i] = xb[i] - static_cast<T>(2 * (xb[i] >= 0) - 1) * scale;
        }
      } else {
        std::fill(lb, lb + block, T(0));
      }
    }
  }
  for (int64_t byte = 0; byte < length / 8; ++byte) {
    const T* xb = x + byte * 8;
    uint8_t bits = 0;
    for (int j = 0; j < 8; ++j) {
      bits |= static_cast<uint8_t>(xb[j] >= 0) << j;
    }
    out[byte] = bits;
  }
}

template <typename T>
void decodeInt8Row(const uint8_t* in, int64_t length, int64_t block, T* out, bool add) {
  const int8_t* q = reinterpret_cast<const int8_t*>(in);
  const uint8_t* scales = in + length;
  for (int64_t b = 0; b * block < length; ++b) {
    const T scale = loadScale<T>(scales + b * sizeof(T));
    const int8_t* qb = q + b * block;
    T* ob = out + b * block;
    if (add) {
      for (int64_t i = 0; i < block; ++i) ob[i] += static_cast<T>(qb[i]) * scale;
    } else {
      for (int64_t i = 0; i < block; ++i) ob[i] = static_cast<T>(qb[i]) * scale;
    }
  }
}

template <typename T>
void decodeSignRow(const uint8_t* in, int64_t length, int64_t block, T* out, bool add) {
  const uint8_t* scales = in + length / 8;
  // Branch-free: the signs are as random as the data, and a branch on each would be
  // mispredicted half the time. Multiplying by +-1 is exact, so the values are +-scale.
  for (int64_t b = 0; b * block < length; ++b) {
    const T scale = loadScale<T>(scales + b * sizeof(T));
    const int64_t end = (b + 1) * block;
    if (add) {
      for (int64_t i = b * block; i < end; ++i) {
        out[i] += static_cast<T>(2 * ((in[i >> 3] >> (i & 7)) & 1) - 1) * scale;
      }
    } else {
      for (int64_t i = b * block; i < end; ++i) {
        out[i] = static_cast<T>(2 * ((in[i >> 3] >> (i & 7)) & 1) - 1) * scale;
      }
    }
  }
}

template <typename T>
void encodeTyped(Codec codec, const T* x, int64_t rows, int64_t length, int64_t block,
                 const int64_t* valid, uint8_t* payload, int64_t stride, T* lost) {
  for (int64_t r = 0; r < rows; ++r) {
    T* l = lost == nullptr ? nullptr : lost + r * length;
    if (codec == Codec::Int8) {
      encodeInt8Row(x + r * length, length, block, payload + r * stride, l);
    } else {
      encodeSignRow(x + r * length, length, block, valid[r], payload + r * stride, l);
    }
  }
}

template <typename T>
void decodeTyped(Codec codec, const uint8_t* payload, int64_t stride, int64_t rows,
                 int64_t length, int64_t block, T* out, bool sumRows) {
  for (int64_t r = 0; r < rows; ++r) {
    T* o = sumRows ? out : out + r * length;
    const bool add = sumRows && r > 0;
    if (codec == Codec::Int8) {
      decodeInt8Row(payload + r * stride, length, block, o, add);
    } else {
      decodeSignRow(payload + r * stride, length, block, o, add);
    }
  }
}

void checkShape(int64_t length, int64_t block, Codec codec) {
  if (block < 1 || length % block != 0 || (codec == Codec::Sign && length % 8 != 0)) {
    throw std::invalid_argument("codec rows of " + std::to_string(length) +
                                " elements do not split into blocks of " +
                                std::to_string(block) +
                                (codec == Codec::Sign ? " and bytes of 8" : ""));
  }
}

} // namespace

void cpuEncode(Codec codec, const void* x, int64_t rows, int64_t length, int64_t block,
               const int64_t* valid, DType dtype, uint8_t* payload, int64_t stride,
               void* lost) {
  checkShape(length, block, codec);
  if (dtype == DType::Float64) {
    encodeTyped(codec, static_cast<const double*>(x), rows, length, block, valid, payload,
                stride, static_cast<double*>(lost));
  } else if (dtype == DType::Float32) {
    encodeTyped(codec, static_cast<const float*>(x), rows, length, block, valid, payload,
                stride, static_cast<float*>(lost));
  } else {
    throw std::invalid_argument("codecs work in float32 or float64");
  }
}

void cpuDecode(Codec codec, const uint8_t* payload, int64_t stride, int64_t rows,
               int64_t length, int64_t block, DType dtype, void* out, bool sumRows) {
  checkShape(length, block, codec);
  if (dtype == DType::Float64) {
    decodeTyped(codec, payload, stride, rows, length, block, static_cast<double*>(out),
                sumRows);
  } else if (dtype == DType::Float32) {
    decodeTyped(codec, payload, stride, rows, length, block, static_cast<float*>(out),
                sumRows);
  } else {
    throw std::invalid_argument("codecs work in float32 or float64");
  }
}

} // namespace kernels
} // namespace tdx
