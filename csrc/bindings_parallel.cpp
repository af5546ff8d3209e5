// The C++ cores of torchdist_ext.parallel (csrc/parallel/) for Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "parallel/flat_layout.h"

namespace py = pybind11;

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
}
