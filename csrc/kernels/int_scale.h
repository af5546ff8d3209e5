// Integer PREMUL_SUM. By a factor that is not a whole number the product is formed in
// double, truncated toward zero and wrapped modulo 2^64 (and so modulo 2^bits of the
// element type), the same answer on the CPU and the GPU; a whole factor is itself reduced
// modulo 2^64 here, so that any whole factor multiplies exactly. (A factor that came as an
// integer tensor skips the double altogether: Load::exactWhole.) A plain cast of a double
// outside the integer type's range is undefined behaviour and gave different garbage per
// type.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define TDX_HOST_DEVICE __host__ __device__
#else
#define TDX_HOST_DEVICE
#endif

namespace tdx {
namespace kernels {

// trunc(x) modulo 2^64; 0 for NaN and infinities (which no integer holds).
TDX_HOST_DEVICE inline uint64_t wrapToUint64(double x) {
  constexpr double kTwo64 = 18446744073709551616.0;
  if (!(x - x == 0.0)) return 0;  // NaN or infinite (isfinite is std:: on the host only)
  const double m = fmod(trunc(x), kTwo64);  // exact: |m| < 2^64, same sign as x
  // 2^64 - |m| would round in double: negate in unsigned arithmetic instead.
  if (m < 0) return uint64_t{0} - static_cast<uint64_t>(-m);
  return static_cast<uint64_t>(m);
}

} // namespace kernels
} // namespace tdx
