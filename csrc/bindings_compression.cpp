// The CPU block codecs (kernels/quantize.h) for torchdist_ext.compression, on tensors.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "kernels/quantize.h"

namespace py = pybind11;

namespace {

using tdx::kernels::Codec;

Codec codecOf(const std::string& name) {
  if (name == "int8") return Codec::Int8;
  if (name == "sign") return Codec::Sign;
  throw std::invalid_argument("unknown codec '" + name + "': int8 or sign");
}

tdx::DType workingDType(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what,
              " must be a contiguous CPU tensor");
  if (t.scalar_type() == at::kFloat) return tdx::DType::Float32;
  if (t.scalar_type() == at::kDouble) return tdx::DType::Float64;
  TORCH_CHECK(false, what, " must be float32 or float64, not ", t.scalar_type());
}

// `payload`: uint8 (rows, bytes) whose rows may be spaced apart (a view past a header).
void checkPayload(const at::Tensor& payload, int64_t rows) {
  TORCH_CHECK(payload.device().is_cpu() && payload.scalar_type() == at::kByte &&
                  payload.dim() == 2 && payload.size(0) == rows &&
                  (payload.size(1) == 0 || payload.stride(1) == 1),
              "payload must be a uint8 CPU tensor of ", rows,
              " rows, each contiguous, not ", payload.sizes(), " ", payload.scalar_type());
}

void encode(const std::string& codec, const at::Tensor& rows, int64_t block,
            const std::vector<int64_t>& valid, at::Tensor& payload,
            c10::optional<at::Tensor> lost) {
  const auto dtype = workingDType(rows, "rows");
  TORCH_CHECK(rows.dim() == 2 && static_cast<int64_t>(valid.size()) == rows.size(0),
              "rows must be 2-D with one valid count per row");
  checkPayload(payload, rows.size(0));
  void* lostPtr = nullptr;
  if (lost.has_value()) {
    workingDType(*lost, "lost");
    TORCH_CHECK(lost->scalar_type() == rows.scalar_type() && lost->numel() == rows.numel(),
                "lost must match rows");
    lostPtr = lost->data_ptr();
  }
  py::gil_scoped_release noGil;
  tdx::kernels::cpuEncode(codecOf(codec), rows.data_ptr(), rows.size(0), rows.size(1), block,
                          valid.data(), dtype, payload.data_ptr<uint8_t>(),
                          payload.stride(0), lostPtr);
}

void decode(const std::string& codec, const at::Tensor& payload, int64_t length,
            int64_t block, at::Tensor& out, bool sumRows) {
  const auto dtype = workingDType(out, "out");
  const int64_t rows = payload.size(0);
  checkPayload(payload, rows);
  TORCH_CHECK(rows > 0 && out.numel() == (sumRows ? 1 : rows) * length,
              "out must hold ", (sumRows ? 1 : rows) * length, " elements");
  py::gil_scoped_release noGil;
  tdx::kernels::cpuDecode(codecOf(codec), payload.data_ptr<uint8_t>(), payload.stride(0), rows,
                          length, block, dtype, out.data_ptr(), sumRows);
}

} // namespace

void bindCompression(py::module& m) {
  m.def("_codec_encode", &encode, py::arg("codec"), py::arg("rows"), py::arg("block"),
        py::arg("valid"), py::arg("payload"), py::arg("lost") = py::none());
  m.def("_codec_decode", &decode, py::arg("codec"), py::arg("payload"), py::arg("length"),
        py::arg("block"), py::arg("out"), py::arg("sum_rows"));
}
