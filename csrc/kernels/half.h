// IEEE binary16 and bfloat16 <-> float conversions (round to nearest even), so the CPU
// kernels need no torch headers.
#pragma once

#include <cstdint>
#include <cstring>

namespace tdx {
namespace kernels {

inline float bitsToFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline uint32_t floatToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline float bf16ToFloat(uint16_t h) {
  return bitsToFloat(static_cast<uint32_t>(h) << 16);
}
inline uint16_t floatToBf16(float f) {
  uint32_t b = floatToBits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((b >> 16) | 0x40);  // quiet NaN
  }
  uint32_t rounding = 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>((b + rounding) >> 16);
}

inline float halfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bitsToFloat(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) {
    return bitsToFloat(sign | 0x7f800000u | (mant << 13));
  }
  return bitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t floatToHalf(float f) {
  uint32_t b = floatToBits(f);
  uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  uint32_t absb = b & 0x7fffffffu;
  if (absb > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absb >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // overflow -> inf
  if (absb < 0x38800000u) {
    // result is subnormal or zero: scale into the subnormal range and round to even.
    float a = bitsToFloat(absb);
    float scaled = a * 16777216.0f;  // 2^24
    uint32_t m = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t exp = (absb >> 23) - 112u;
  uint32_t mant = absb & 0x7fffffu;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: fine
  return static_cast<uint16_t>(sign | h);
}

} // namespace kernels
} // namespace tdx
