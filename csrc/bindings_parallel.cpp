// The C++ cores of torchdist_ext.parallel (csrc/parallel/) for Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "parallel/flat_layout.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/staleness_clock.h"
#include "parallel/weight_versions.h"

namespace py = pybind11;

namespace {

using tdx::parallel::PipeAction;
using tdx::parallel::PipeVerb;

PipeVerb verbOf(const std::string& name) {
  for (auto v : {PipeVerb::Forward, PipeVerb::Backward, PipeVerb::SendAct, PipeVerb::RecvAct,
                 PipeVerb::SendGrad, PipeVerb::RecvGrad}) {
    if (name == tdx::parallel::pipeVerbName(v)) return v;
  }
  throw std::invalid_argument("unknown pipeline action '" + name +
                              "': F, B, SA, RA, SG or RG");
}

// Actions cross as (name, microbatch) pairs: ("F", 0), ("SA", 0), ...
std::vector<std::vector<PipeAction>> actionsOf(
    const std::vector<std::vector<std::pair<std::string, int64_t>>>& lists) {
  std::vector<std::vector<PipeAction>> out(lists.size());
  for (size_t s = 0; s < lists.size(); ++s) {
    for (const auto& [name, mb] : lists[s]) out[s].push_back({verbOf(name), mb});
  }
  return out;
}

} // namespace

void bindParallel(py::module& m) {
  using tdx::parallel::BucketSlot;
  using tdx::parallel::BucketTracker;
  using tdx::parallel::FlatLayout;
  using tdx::parallel::ParamSlot;
  py::class_<ParamSlot>(m, "_ParamSlot")
      .def_readonly("bucket", &ParamSlot::bucket)
      .def_readonly("offset", &ParamSlot::offset)
      .def_readonly("numel", &ParamSlot::numel);
  py::class_<BucketSlot>(m, "_BucketSlot")
      .def_readonly("first_param", &BucketSlot::firstParam)
      .def_readonly("last_param", &BucketSlot::lastParam)
      .def_readonly("offset", &BucketSlot::offset)
      .def_readonly("numel", &BucketSlot::numel)
      .def_readonly("shard_numel", &BucketSlot::shardNumel)
      .def_readonly("shard_offset", &BucketSlot::shardOffset);
  py::class_<FlatLayout>(m, "_FlatLayout")
      .def(py::init<std::vector<int64_t>, int64_t, int64_t, int64_t>(), py::arg("numels"),
           py::arg("world_size"), py::arg("bucket_numel"), py::arg("align"))
      .def_property_readonly("params", &FlatLayout::params)
      .def_property_readonly("buckets", &FlatLayout::buckets)
      .def_property_readonly("world_size", &FlatLayout::worldSize)
      .def_property_readonly("numel", &FlatLayout::numel)
      .def_property_readonly("shard_numel", &FlatLayout::shardNumel)
      .def("owned_numel", &FlatLayout::ownedNumel, py::arg("rank"))
      .def("describe", &FlatLayout::describe);
  py::class_<BucketTracker>(m, "_BucketTracker")
      .def(py::init<std::vector<int64_t>>(), py::arg("bucket_of_param"))
      .def("mark", &BucketTracker::mark, py::arg("index"))
      .def("finish", &BucketTracker::finish)
      .def("missing", &BucketTracker::missing)
      .def_property_readonly("started", &BucketTracker::started);
  using tdx::parallel::WeightPlan;
  py::class_<WeightPlan>(m, "_WeightPlan")
      .def_readonly("version", &WeightPlan::version)
      .def_readonly("stashed", &WeightPlan::stashed)
      .def_readonly("update_after", &WeightPlan::updateAfter)
      .def_readonly("peak_copies", &WeightPlan::peakCopies)
      .def_readonly("end_version", &WeightPlan::endVersion)
      .def_readonly("end_copies", &WeightPlan::endCopies);
  m.def(
      "_plan_weights",
      [](const std::vector<std::pair<std::string, int64_t>>& actions, int64_t stage,
         int64_t microbatches, const std::string& mode, int64_t updateEvery,
         int64_t startVersion) {
        tdx::parallel::WeightUpdate kind;
        if (mode == "pipedream") {
          kind = tdx::parallel::WeightUpdate::PerMicrobatch;
        } else if (mode == "2bw") {
          kind = tdx::parallel::WeightUpdate::DoubleBuffered;
        } else {
          throw std::invalid_argument("unknown weight update mode '" + mode +
                                      "': pipedream or 2bw");
        }
        return tdx::parallel::planWeights(actionsOf({actions})[0], stage, microbatches, kind,
                                          updateEvery, startVersion);
      },
      py::arg("actions"), py::arg("stage"), py::arg("microbatches"), py::arg("mode"),
      py::arg("update_every"), py::arg("start_version"));
  using tdx::parallel::StalenessClock;
  py::class_<StalenessClock>(m, "_StalenessClock")
      .def(py::init<int64_t, int64_t>(), py::arg("workers"), py::arg("max_staleness"))
      .def("push", &StalenessClock::push, py::arg("worker"))
      .def("close", &StalenessClock::close, py::arg("worker"))
      .def("clock", &StalenessClock::clock, py::arg("worker"))
      .def("held", &StalenessClock::held, py::arg("worker"))
      .def("closed", &StalenessClock::closed, py::arg("worker"))
      .def_property_readonly("workers", &StalenessClock::workers)
      .def_property_readonly("max_staleness", &StalenessClock::maxStaleness)
      .def_property_readonly("all_closed", &StalenessClock::allClosed)
      .def_property_readonly("min_clock", &StalenessClock::minClock)
      .def_property_readonly("widest_gap", &StalenessClock::widestGap)
      .def("describe", &StalenessClock::describe);
  using tdx::parallel::PipelineSchedule;
  py::class_<PipelineSchedule>(m, "_PipelineSchedule")
      .def(py::init([](const std::vector<std::vector<std::pair<std::string, int64_t>>>& lists,
                       int64_t microbatches) {
             return PipelineSchedule(actionsOf(lists), microbatches);
           }),
           py::arg("actions"), py::arg("microbatches"))
      .def_static("gpipe", &PipelineSchedule::gpipe, py::arg("stages"), py::arg("microbatches"))
      .def_static("one_f_one_b", &PipelineSchedule::oneFOneB, py::arg("stages"),
                  py::arg("microbatches"))
      .def_property_readonly("stages", &PipelineSchedule::stages)
      .def_property_readonly("microbatches", &PipelineSchedule::microbatches)
      .def("actions",
           [](const PipelineSchedule& p, int64_t stage) {
             std::vector<std::pair<std::string, int64_t>> out;
             for (const auto& a : p.actions(stage)) {
               out.emplace_back(tdx::parallel::pipeVerbName(a.verb), a.microbatch);
             }
             return out;
           },
           py::arg("stage"))
      .def_property_readonly("peak_in_flight", &PipelineSchedule::peakInFlight)
      .def_property_readonly("makespan", &PipelineSchedule::makespan)
      .def_property_readonly("bubble", &PipelineSchedule::bubble)
      .def("grid", &PipelineSchedule::grid);
}
