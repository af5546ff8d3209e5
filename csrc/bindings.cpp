// torchdist_ext._C: the backend factory torch.distributed calls, and a few introspection
// helpers. Registration itself happens in torchdist_ext/__init__.py.
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <ucp/api/ucp.h>

#include "c10d/ProcessGroupTDX.hpp"
#include "c10d/Validation.hpp"
#include "common/env.h"
#include "common/host.h"
#include "kernels/reduce.h"
#include "transport/ucx/ucx_transport.h"

#ifdef TDX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/reduce_cuda.h"
#include "transport/peer_memory/cuda_ipc.h"
#endif

namespace {

// The reduction kernels alone, for tests: outputs[j][i] = op over k of inputs[k][i].
// `op` is a ReduceOp name; AVG divides the sum by len(inputs), PREMUL_SUM scales each
// input by `factor`. CPU tensors use the CPU kernels, CUDA tensors the CUDA kernels on
// the current stream.
void multiReduce(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                 const std::string& op, double factor) {
  TORCH_CHECK_VALUE(!inputs.empty(), "_multi_reduce: needs at least one input");
  const at::Tensor& ref = inputs[0];
  for (const auto& t : inputs) {
    TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() == ref.numel() &&
                          t.scalar_type() == ref.scalar_type() && t.device() == ref.device(),
                      "_multi_reduce: every tensor must be contiguous, of one dtype, numel "
                      "and device");
  }
  for (const auto& t : outputs) {
    TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() == ref.numel() &&
                          t.scalar_type() == ref.scalar_type() && t.device() == ref.device(),
                      "_multi_reduce: every tensor must be contiguous, of one dtype, numel "
                      "and device");
  }
  static const std::map<std::string, c10d::ReduceOp::RedOpType> kOps = {
      {"SUM", c10d::ReduceOp::SUM},   {"PRODUCT", c10d::ReduceOp::PRODUCT},
      {"MIN", c10d::ReduceOp::MIN},   {"MAX", c10d::ReduceOp::MAX},
      {"BAND", c10d::ReduceOp::BAND}, {"BOR", c10d::ReduceOp::BOR},
      {"BXOR", c10d::ReduceOp::BXOR}, {"AVG", c10d::ReduceOp::AVG},
      {"PREMUL_SUM", c10d::ReduceOp::PREMUL_SUM}};
  auto it = kOps.find(op);
  TORCH_CHECK_VALUE(it != kOps.end(), "_multi_reduce: unknown op ", op);
  c10d::ReduceOp rop;  // the PREMUL_SUM constructor refuses a factor-less op, so set fields
  rop.op_ = it->second;
  if (op == "PREMUL_SUM") rop.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(factor);
  const int n = static_cast<int>(inputs.size());
  const tdx::Reduction red = tdx::makeReduction("_multi_reduce", rop, ref.scalar_type(), n);
  if (ref.is_cuda()) {
#ifdef TDX_WITH_CUDA
    TORCH_CHECK_VALUE(n <= tdx::kernels::kMaxMultiBuffers &&
                          outputs.size() <= static_cast<size_t>(tdx::kernels::kMaxMultiBuffers),
                      "_multi_reduce: at most ", tdx::kernels::kMaxMultiBuffers, " buffers");
    c10::cuda::CUDAGuard guard(ref.device());
    tdx::kernels::MultiReduceArgs a = red.multiReduceArgs(n);
    for (int k = 0; k < n; ++k) a.inputs[k] = inputs[k].data_ptr();
    for (size_t j = 0; j < outputs.size(); ++j) a.outputs[j] = outputs[j].data_ptr();
    a.numInputs = n;
    a.numOutputs = static_cast<int>(outputs.size());
    a.count = ref.numel();
    tdx::kernels::cudaMultiReduce(a, c10::cuda::getCurrentCUDAStream().stream());
    return;
#else
    TORCH_CHECK(false, "_multi_reduce: this build of torchdist_ext has no CUDA kernels");
#endif
  }
  // CPU: the same arithmetic the host path of the collectives runs.
  const tdx::kernels::Load load = red.load(n);
  at::Tensor acc = at::empty_like(inputs[0]);
  load(acc.data_ptr(), inputs[0].data_ptr(), acc.nbytes());
  at::Tensor scaled = load.scales && n > 1 ? at::empty_like(acc) : at::Tensor();
  for (int k = 1; k < n; ++k) {
    at::Tensor x = inputs[k];
    if (load.scales) {
      load(scaled.data_ptr(), x.data_ptr(), x.nbytes());
      x = scaled;
    }
    red.fn(acc.data_ptr(), x.data_ptr(), acc.numel());
  }
  load.finish(acc.data_ptr(), acc.nbytes());
  for (const auto& o : outputs) o.copy_(acc);
}

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

void bindAlgorithms(py::module& m);  // bindings_algorithms.cpp
void bindCompression(py::module& m);  // bindings_compression.cpp
void bindParallel(py::module& m);  // bindings_parallel.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tdx: a UCX-based torch.distributed backend";
  py::class_<tdx::ProcessGroupTDX, c10d::Backend, c10::intrusive_ptr<tdx::ProcessGroupTDX>>(
      m, "ProcessGroupTDX")
      .def_property_readonly("group_name", &tdx::ProcessGroupTDX::groupName)
      .def_property_readonly("peer_ops_run", &tdx::ProcessGroupTDX::peerOpsRun)
      .def_property_readonly("tag_id", &tdx::ProcessGroupTDX::tagId)
      .def_property_readonly("placement",
                             [](const tdx::ProcessGroupTDX& pg) {
                               py::dict d;
                               d["one_host"] = pg.placement().oneHost;
                               d["windows"] = pg.placement().windows;
                               d["crowded"] = pg.placement().crowded;
                               d["pass_threads"] = pg.placement().passThreads;
                               return d;
                             })
      .def("predict",
           [](const tdx::ProcessGroupTDX& pg, const std::string& collective, double bytes) {
             const auto c = pg.predict(tdx::algorithms::collectiveFromName(collective), bytes);
             return py::make_tuple(c.algorithm->name, c.predicted);
           })
      .def("flight_record", [](const tdx::ProcessGroupTDX& pg) {
        py::list out;
        for (const auto& e : pg.flightRecord()) {
          py::dict d;
          d["id"] = e.id;
          d["seq"] = e.seq;
          d["op"] = e.op;
          d["detail"] = e.detail;
          d["path"] = e.path;
          d["state"] = e.state;
          d["steps_done"] = e.stepsDone;
          d["error"] = e.error;
          d["queued_at_ms"] = e.queuedAtMs;
          d["duration_ms"] = e.durationMs;
          out.append(d);
        }
        return out;
      })
      .def(
          "dump_flight_record",
          [](const tdx::ProcessGroupTDX& pg, const std::string& reason) {
            pg.dumpFlightRecord(reason);
          },
          py::arg("reason"))
      .def("allreduce_into", &tdx::ProcessGroupTDX::allreduceInto, py::arg("output"),
           py::arg("input"), py::arg("opts"), py::call_guard<py::gil_scoped_release>());
  m.def("_create_backend", &createBackend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::arg("group_name"), py::arg("global_ranks"),
        py::call_guard<py::gil_scoped_release>());
  m.def("_group_ids_held_for_good", &tdx::groupIdsHeldForGood);
  m.def("_multi_reduce", &multiReduce, py::arg("inputs"), py::arg("outputs"), py::arg("op"),
        py::arg("factor") = 1.0);
  m.def("cuda_enabled", [] {
#ifdef TDX_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("stream_memops_available", [] {
#ifdef TDX_WITH_CUDA
    return tdx::transport::peer::streamMemOpsAvailable();
#else
    return false;
#endif
  });
  bindAlgorithms(m);
  bindCompression(m);
  bindParallel(m);
  m.def("ucx_version", [] { return std::string(ucp_get_version_string()); });
  // The CPUs this process may use (affinity mask, capped by a cgroup v2 quota), as tdx
  // counts them when it judges whether ranks outnumber them.
  m.def("_usable_cpus", [] { return tdx::usableCpus(); });
  // The pieces of that count, for tests: the cgroup limits read from a given cgroup file
  // and hierarchy, this process's published CPU text, and how many processes of one host
  // run at once from such texts.
  m.def(
      "_cpu_limits",
      [](const std::string& procCgroup, const std::string& root) {
        std::vector<std::pair<std::string, int>> out;
        for (const auto& l : tdx::cpuLimits(procCgroup, root)) out.emplace_back(l.cgroup, l.cpus);
        return out;
      },
      py::arg("proc_cgroup") = "/proc/self/cgroup", py::arg("root") = "/sys/fs/cgroup");
  m.def("_cpu_text", [] { return tdx::cpuText(); });
  m.def("_cpus_together", &tdx::cpusTogether, py::arg("texts"));
  m.def("_cpus_shared", &tdx::cpusShared, py::arg("texts"));
  m.def("transport_info", [] {
    py::dict info;
    auto t = tdx::transport::UcxTransport::current();
    info["running"] = t != nullptr;
    // Memory kept for transfers that were given up on but that UCX had not let go of
    // (see Request::holdUntilReleased); it returns to the allocator as UCX lets go.
    info["held_bytes"] = tdx::transport::heldBytes().load();
    if (!t) return info;
    info["tcp"] = t->tcpLoaded();
    info["rndv_thresh"] = t->rendezvousThreshold();
    py::list endpoints;
    for (const auto& e : t->endpointInfo()) {
      py::dict d;
      d["id"] = e.id;
      d["pid"] = e.pid;
      d["same_host"] = e.sameHost;
      d["watched"] = e.watched;
      d["peer_errors"] = e.peerErrors;
      d["lost"] = e.failed;
      endpoints.append(d);
    }
    info["endpoints"] = endpoints;
    {
      // This may be the last reference (a group destroyed meanwhile on another thread):
      // stopping the transport joins its progress thread, which may be freeing a held
      // tensor whose Python object needs the GIL.
      py::gil_scoped_release release;
      t.reset();
    }
    return info;
  });
  m.def("env_knobs", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& k : tdx::env::knobs()) out.emplace_back(k.name, k.defaultValue, k.help);
    return out;
  });
}
