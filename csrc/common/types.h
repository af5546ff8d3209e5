// Element types and reduction kinds shared by kernels, algorithms and the c10d adapter.
// Kept free of torch so the lower layers stay torch-agnostic; csrc/c10d maps at::ScalarType
// and c10d::ReduceOp onto these.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tdx {

enum class DType : uint8_t {
  Float32,
  Float64,
  Float16,
  BFloat16,
  Int8,
  UInt8,
  Int16,
  Int32,
  Int64,
  Bool,
};

// AVG and PREMUL_SUM are SUM plus a scaling done around the collective, so the
// reduction kernels only know these.
enum class ReduceKind : uint8_t { Sum, Product, Min, Max, BitAnd, BitOr, BitXor };

size_t elementSize(DType t);
const char* dtypeName(DType t);
const char* reduceKindName(ReduceKind k);
bool isFloating(DType t);

} // namespace tdx
