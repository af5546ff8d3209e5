// torchdist_ext._C: the backend factory torch.distributed calls, and a few introspection
// helpers. Registration itself happens in torchdist_ext/__init__.py.
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <ucp/api/ucp.h>

#include "c10d/ProcessGroupTDX.hpp"
#include "common/env.h"

namespace {

c10::intrusive_ptr<tdx::ProcessGroupTDX> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& groupName,
    const std::vector<int64_t>& globalRanks) {
  auto options = c10::make_intrusive<c10d::Backend::Options>("tdx", timeout);
  options->group_name = groupName;
  options->global_ranks_in_group.assign(globalRanks.begin(), globalRanks.end());
  return c10::make_intrusive<tdx::ProcessGroupTDX>(store, rank, size, options, globalRanks);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tdx: a UCX-based torch.distributed backend";
  py::class_<tdx::ProcessGroupTDX, c10d::Backend, c10::intrusive_ptr<tdx::ProcessGroupTDX>>(
      m, "ProcessGroupTDX")
      .def_property_readonly("group_name", &tdx::ProcessGroupTDX::groupName);
  m.def("_create_backend", &createBackend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::arg("group_name"), py::arg("global_ranks"),
        py::call_guard<py::gil_scoped_release>());
  m.def("ucx_version", [] { return std::string(ucp_get_version_string()); });
  m.def("env_knobs", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& k : tdx::env::knobs()) out.emplace_back(k.name, k.defaultValue, k.help);
    return out;
  });
}
