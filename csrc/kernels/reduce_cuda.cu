// CUDA reductions for every ReduceKind x DType (see reduce_cuda.h for the contract).
//
// One kernel shape serves every caller: N input buffers reduced element-wise into M output
// buffers. The pairwise form (ring and halving-doubling steps) is N=2, M=1; the same-host
// peer-memory allreduce is N=M=ranks, reading and writing other ranks' buffers mapped
// through CUDA IPC. Each thread moves 16 bytes per buffer per iteration when every buffer
// is 16-byte aligned, which is what lets the kernel run at HBM bandwidth; misaligned
// buffers (views into a tensor) take the element-wise path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/int_scale.h"
#include "kernels/reduce_cuda.h"

namespace tdx {
namespace kernels {
namespace {

constexpr int kThreads = 512;

// Accumulator type: narrow floats accumulate in float, as torch's own reductions do.
template <typename T> struct AccOf { using type = T; };
template <> struct AccOf<__half> { using type = float; };
template <> struct AccOf<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename AccOf<T>::type toAcc(T x) { return x; }
template <> __device__ __forceinline__ float toAcc<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float toAcc<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T fromAcc(typename AccOf<T>::type x) {
  return static_cast<T>(x);
}
template <> __device__ __forceinline__ __half fromAcc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 fromAcc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The same expressions as the CPU kernels, so NaN handling of MIN/MAX agrees.
// Integers wrap modulo 2^bits, computed on an unsigned type at least as wide as int (as
// the CPU kernels do): signed overflow would be undefined behaviour.
template <class A>
using Wrap = typename std::conditional<(sizeof(A) < sizeof(unsigned)), unsigned,
                                       typename std::make_unsigned<A>::type>::type;
struct Sum {
  template <class A> __device__ static A apply(A a, A b) {
    if constexpr (std::is_integral<A>::value) {
      return static_cast<A>(static_cast<Wrap<A>>(a) + static_cast<Wrap<A>>(b));
    } else {
      return a + b;
    }
  }
};
struct Prod {
  template <class A> __device__ static A apply(A a, A b) {
    if constexpr (std::is_integral<A>::value) {
      return static_cast<A>(static_cast<Wrap<A>>(a) * static_cast<Wrap<A>>(b));
    } else {
      return a * b;
    }
  }
};
struct Min {
  template <class A> __device__ static A apply(A a, A b) { return (b < a || b != b) ? b : a; }
};
struct Max {
  template <class A> __device__ static A apply(A a, A b) { return (b > a || b != b) ? b : a; }
};
struct BitAnd { template <class A> __device__ static A apply(A a, A b) { return a & b; } };
struct BitOr { template <class A> __device__ static A apply(A a, A b) { return a | b; } };
struct BitXor { template <class A> __device__ static A apply(A a, A b) { return a ^ b; } };

template <typename T>
struct Params {
  const T* in[kMaxMultiBuffers];
  T* out[kMaxMultiBuffers];
  int numIn;
  int numOut;
  size_t count;
  bool premul;
  double factor;
  bool wholeFactor;    // factor is a whole number: integers multiply by intFactor exactly
  long long intFactor;
  int64_t divisor;
};

template <typename T>
__device__ __forceinline__ typename AccOf<T>::type start(const Params<T>& p, T x) {
  using A = typename AccOf<T>::type;
  if (p.premul) {
    if constexpr (std::is_integral<A>::value) {
      // A whole factor multiplies exactly, modulo 2^bits, as on the CPU (through double,
      // int64 values above 2^53 would be rounded).
      if (p.wholeFactor) {
        return static_cast<A>(static_cast<unsigned long long>(static_cast<long long>(x)) *
                              static_cast<unsigned long long>(p.intFactor));
      }
      return static_cast<A>(wrapToUint64(static_cast<double>(x) * p.factor));
    }
    return static_cast<A>(static_cast<double>(toAcc<T>(x)) * p.factor);
  }
  return toAcc<T>(x);
}

template <typename T>
__device__ __forceinline__ T finish(const Params<T>& p, typename AccOf<T>::type a) {
  using A = typename AccOf<T>::type;
  if (p.divisor > 1) {
    if constexpr (std::is_integral<A>::value) {
      // Truncating, in int64: the group size need not fit A (256 ranks is 0 as a uint8).
      a = static_cast<A>(static_cast<long long>(a) / static_cast<long long>(p.divisor));
    } else {
      a = a / static_cast<A>(p.divisor);
    }
  }
  return fromAcc<T>(a);
}

template <typename T, typename Op>
__device__ __forceinline__ void reduceElement(const Params<T>& p, size_t i) {
  auto acc = start(p, p.in[0][i]);
  for (int k = 1; k < p.numIn; ++k) acc = Op::apply(acc, start(p, p.in[k][i]));
  const T r = finish(p, acc);
  for (int j = 0; j < p.numOut; ++j) p.out[j][i] = r;
}

// kVec: every buffer is 16-byte aligned, so whole 16-byte vectors are loaded and stored;
// the remainder (count not a multiple of the vector) goes element by element.
template <typename T, typename Op, bool kVec>
__global__ void __launch_bounds__(kThreads) multiReduceKernel(Params<T> p) {
  constexpr int kV = 16 / sizeof(T);
  using A = typename AccOf<T>::type;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t first = 0;
  if constexpr (kVec) {
    const size_t nvec = p.count / kV;
    for (size_t v = tid; v < nvec; v += stride) {
      union Vec {
        uint4 raw;
        T e[kV];
      };
      A acc[kV];
      Vec x;
      x.raw = reinterpret_cast<const uint4*>(p.in[0])[v];
#pragma unroll
      for (int e = 0; e < kV; ++e) acc[e] = start(p, x.e[e]);
      for (int k = 1; k < p.numIn; ++k) {
        x.raw = reinterpret_cast<const uint4*>(p.in[k])[v];
#pragma unroll
        for (int e = 0; e < kV; ++e) acc[e] = Op::apply(acc[e], start(p, x.e[e]));
      }
#pragma unroll
      for (int e = 0; e < kV; ++e) x.e[e] = finish(p, acc[e]);
      for (int j = 0; j < p.numOut; ++j) reinterpret_cast<uint4*>(p.out[j])[v] = x.raw;
    }
    first = nvec * kV;
  }
  for (size_t i = first + tid; i < p.count; i += stride) reduceElement<T, Op>(p, i);
}

int multiprocessors() {
  static std::atomic<int> cached[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      n = 132;
    }
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <typename T, typename Op>
void launch(const MultiReduceArgs& a, cudaStream_t stream) {
  Params<T> p{};
  bool aligned = true;
  for (int k = 0; k < a.numInputs; ++k) {
    p.in[k] = static_cast<const T*>(a.inputs[k]);
    aligned = aligned && reinterpret_cast<uintptr_t>(a.inputs[k]) % 16 == 0;
  }
  for (int j = 0; j < a.numOutputs; ++j) {
    p.out[j] = static_cast<T*>(a.outputs[j]);
    aligned = aligned && reinterpret_cast<uintptr_t>(a.outputs[j]) % 16 == 0;
  }
  p.numIn = a.numInputs;
  p.numOut = a.numOutputs;
  p.count = a.count;
  p.premul = a.premul;
  p.factor = a.premulFactor;
  // Any whole factor multiplies exactly modulo 2^64, as on the CPU; inf is no whole
  // number here (an integer's factor is checked finite at the call).
  p.wholeFactor = a.exactWhole || a.premulFactor == std::trunc(a.premulFactor);
  p.intFactor = a.exactWhole    ? static_cast<long long>(a.wholeFactor)
                : p.wholeFactor ? static_cast<long long>(wrapToUint64(a.premulFactor))
                                : 0;
  p.divisor = a.divisor;

  constexpr size_t kV = 16 / sizeof(T);
  const size_t units = aligned ? (a.count / kV + a.count % kV) : a.count;
  const size_t wanted = (units + kThreads - 1) / kThreads;
  // Four 512-thread blocks fill an SM; more only adds scheduling work to a grid-stride loop.
  const size_t cap = static_cast<size_t>(multiprocessors()) * 4;
  const unsigned blocks = static_cast<unsigned>(wanted < cap ? wanted : cap);
  if (aligned) {
    multiReduceKernel<T, Op, true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    multiReduceKernel<T, Op, false><<<blocks, kThreads, 0, stream>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("tdx reduction kernel launch failed: ") +
                             cudaGetErrorString(err));
  }
}

template <typename T>
void launchArith(const MultiReduceArgs& a, cudaStream_t s) {
  switch (a.kind) {
    case ReduceKind::Sum: return launch<T, Sum>(a, s);
    case ReduceKind::Product: return launch<T, Prod>(a, s);
    case ReduceKind::Min: return launch<T, Min>(a, s);
    case ReduceKind::Max: return launch<T, Max>(a, s);
    default: break;
  }
  throw std::invalid_argument(std::string("reduce op ") + reduceKindName(a.kind) +
                              " is not defined on " + dtypeName(a.dtype) + " tensors");
}

template <typename T>
void launchIntegral(const MultiReduceArgs& a, cudaStream_t s) {
  switch (a.kind) {
    case ReduceKind::BitAnd: return launch<T, BitAnd>(a, s);
    case ReduceKind::BitOr: return launch<T, BitOr>(a, s);
    case ReduceKind::BitXor: return launch<T, BitXor>(a, s);
    default: return launchArith<T>(a, s);
  }
}

// bool is stored as 0/1 bytes: SUM and MAX are OR, PRODUCT and MIN are AND (as NCCL does).
void launchBool(const MultiReduceArgs& a, cudaStream_t s) {
  switch (a.kind) {
    case ReduceKind::Sum:
    case ReduceKind::Max:
    case ReduceKind::BitOr: return launch<uint8_t, BitOr>(a, s);
    case ReduceKind::Product:
    case ReduceKind::Min:
    case ReduceKind::BitAnd: return launch<uint8_t, BitAnd>(a, s);
    case ReduceKind::BitXor: return launch<uint8_t, BitXor>(a, s);
  }
}

} // namespace

bool cudaReduceSupported(DType dtype, ReduceKind kind) {
  const bool bitwise = kind == ReduceKind::BitAnd || kind == ReduceKind::BitOr ||
                       kind == ReduceKind::BitXor;
  return !(bitwise && isFloating(dtype));
}

void cudaMultiReduce(const MultiReduceArgs& a, void* stream) {
  if (a.numInputs < 1 || a.numInputs > kMaxMultiBuffers || a.numOutputs < 0 ||
      a.numOutputs > kMaxMultiBuffers) {
    throw std::invalid_argument("tdx multi-reduce takes 1.." + std::to_string(kMaxMultiBuffers) +
                                " inputs and 0.." + std::to_string(kMaxMultiBuffers) +
                                " outputs, got " + std::to_string(a.numInputs) + " and " +
                                std::to_string(a.numOutputs));
  }
  if (!cudaReduceSupported(a.dtype, a.kind)) {
    throw std::invalid_argument(std::string("reduce op ") + reduceKindName(a.kind) +
                                " is not defined on " + dtypeName(a.dtype) + " tensors");
  }
  if (a.count == 0 || a.numOutputs == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::Float32: return launchArith<float>(a, s);
    case DType::Float64: return launchArith<double>(a, s);
    case DType::Float16: return launchArith<__half>(a, s);
    case DType::BFloat16: return launchArith<__nv_bfloat16>(a, s);
    case DType::Int8: return launchIntegral<int8_t>(a, s);
    case DType::UInt8: return launchIntegral<uint8_t>(a, s);
    case DType::Int16: return launchIntegral<int16_t>(a, s);
    case DType::Int32: return launchIntegral<int32_t>(a, s);
    case DType::Int64: return launchIntegral<int64_t>(a, s);
    case DType::Bool: return launchBool(a, s);
  }
}

void cudaReduce(void* dst, const void* src, size_t count, DType dtype, ReduceKind kind,
                void* stream) {
  MultiReduceArgs a;
  a.inputs[0] = dst;
  a.inputs[1] = src;
  a.numInputs = 2;
  a.outputs[0] = dst;
  a.numOutputs = 1;
  a.count = count;
  a.dtype = dtype;
  a.kind = kind;
  cudaMultiReduce(a, stream);
}

} // namespace kernels
} // namespace tdx
