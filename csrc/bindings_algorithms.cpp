// The algorithm registry, cost model and plans, for torchdist_ext.algorithms(),
// set_algorithm(), the bench's calibration and the plan-invariant tests.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algorithms/collectives.h"
#include "algorithms/pass_pool.h"
#include "algorithms/registry.h"
#include "algorithms/shm_collectives.h"

namespace py = pybind11;

namespace {

using namespace tdx::algorithms;

py::tuple spanTuple(const Span& s) {
  return py::make_tuple(regionName(s.region), s.block, s.offset, s.bytes);
}

py::dict linkDict(const LinkCost& l) {
  py::dict d;
  d["alpha"] = l.alpha;
  d["beta"] = l.beta;
  d["gamma"] = l.gamma;
  return d;
}

const Algorithm& lookup(const std::string& collective, const std::string& name) {
  const Algorithm* a = Registry::get().find(collectiveFromName(collective), name);
  if (a == nullptr) {
    throw std::invalid_argument("unknown " + collective + " algorithm '" + name + "'");
  }
  return *a;
}

} // namespace

void bindAlgorithms(py::module& m) {
  m.def("_algorithms", [] {
    py::list out;
    for (const auto& a : Registry::get().all()) {
      py::dict d;
      d["collective"] = collectiveName(a.collective);
      d["name"] = a.name;
      d["link"] = linkName(a.link);
      d["power_of_two_only"] = a.powerOfTwoOnly;
      d["has_plan"] = a.plan != nullptr;
      d["needs_cross_memory"] = a.needsCrossMemory;
      d["summary"] = a.summary;
      out.append(d);
    }
    return out;
  });
  m.def("_set_algorithm", [](const std::string& collective, const std::string& name) {
    Registry::get().setOverride(collectiveFromName(collective), name);
  });
  m.def("_get_algorithm", [](const std::string& collective) {
    const std::string o = Registry::get().override(collectiveFromName(collective));
    return o.empty() ? std::string("auto") : o;
  });
  m.def("_cost_model", [] {
    const CostModel m = Registry::get().costModel();
    py::dict d;
    for (int i = 0; i < kNumLinks; ++i) d[linkName(static_cast<Link>(i))] = linkDict(m.links[i]);
    return d;
  });
  m.def("_set_cost_model", [](const py::dict& d) {
    CostModel m = Registry::get().costModel();
    for (int i = 0; i < kNumLinks; ++i) {
      const char* name = linkName(static_cast<Link>(i));
      if (!d.contains(name)) continue;
      py::dict l = d[name];
      m.links[i] = {l["alpha"].cast<double>(), l["beta"].cast<double>(),
                    l["gamma"].cast<double>()};
      if (m.links[i].alpha < 0 || m.links[i].beta < 0 || m.links[i].gamma < 0) {
        throw std::invalid_argument(std::string("cost model for ") + name +
                                    " has a negative term");
      }
    }
    Registry::get().setCostModel(m);
  });
  // Rules as dicts: {collective, world, placement, crowded, threads, min_bytes,
  // max_bytes, algorithm}, sizes in [min_bytes, max_bytes); a dict without threads has 1.
  m.def("_cost_rules", [] {
    py::list out;
    for (const Rule& r : Registry::get().costModel().rules) {
      py::dict d;
      d["collective"] = collectiveName(r.collective);
      d["world"] = r.world;
      d["placement"] = spreadName(r.spread);
      d["crowded"] = r.crowded;
      d["threads"] = r.threads;
      d["min_bytes"] = r.fromBytes;
      d["max_bytes"] = r.toBytes;
      d["algorithm"] = r.algorithm;
      out.append(d);
    }
    return out;
  });
  m.def("_set_cost_rules", [](const py::list& rules) {
    CostModel m = Registry::get().costModel();
    m.rules.clear();
    for (const auto& item : rules) {
      const py::dict d = item.cast<py::dict>();
      for (const char* key : {"collective", "world", "placement", "crowded", "min_bytes",
                              "max_bytes", "algorithm"}) {
        if (!d.contains(key)) {
          throw std::invalid_argument(std::string("measured rule ") +
                                      py::str(item).cast<std::string>() + " has no '" + key +
                                      "'");
        }
      }
      Rule r;
      r.collective = collectiveFromName(d["collective"].cast<std::string>());
      r.world = d["world"].cast<int>();
      r.spread = spreadFromName(d["placement"].cast<std::string>());
      r.crowded = d["crowded"].cast<bool>();
      r.fromBytes = d["min_bytes"].cast<double>();
      r.toBytes = d["max_bytes"].cast<double>();
      r.algorithm = d["algorithm"].cast<std::string>();
      if (d.contains("threads")) {
        // A count, as the file loader takes it: not a bool (an int to Python) or a float.
        const py::object t = d["threads"];
        if (!py::isinstance<py::int_>(t) || py::isinstance<py::bool_>(t)) {
          const auto type = py::str(py::type::of(t).attr("__name__")).cast<std::string>();
          throw std::invalid_argument(std::string("measured rule ") +
                                      py::str(item).cast<std::string>() +
                                      ": threads must be a whole number, not " + type);
        }
        r.threads = t.cast<int>();
      }
      m.rules.push_back(std::move(r));
    }
    Registry::get().setCostModel(m);  // checks every rule
  });
  m.attr("_MAX_PASS_THREADS") = kMaxPassThreads;
  // Runs passes of `bytes` through the helper pool, `repeats` times over the list of
  // ways, and checks that every pass covered each byte exactly once, in parts cut on
  // `grain`. For the pool's tests and its overhead in the bench: no collective involved.
  m.def(
      "_pass_pool_check",
      [](size_t bytes, size_t grain, const std::vector<int>& ways, int repeats) {
        if (grain == 0 || repeats < 0 || ways.empty()) {
          throw std::invalid_argument("_pass_pool_check: grain >= 1, repeats >= 0 and a "
                                      "non-empty list of ways are required");
        }
        std::vector<uint32_t> covered(bytes, 0);
        std::atomic<bool> misCut{false};
        std::atomic<int> partsMax{0};
        size_t passes = 0;
        double seconds = 0;
        {
          py::gil_scoped_release release;
          const auto start = std::chrono::steady_clock::now();
          for (int r = 0; r < repeats; ++r) {
            for (int w : ways) {
              std::atomic<int> parts{0};
              parallelPass(bytes, grain, w, [&](size_t begin, size_t end) {
                parts.fetch_add(1, std::memory_order_relaxed);
                if (begin % grain != 0 || (end % grain != 0 && end != bytes)) {
                  misCut.store(true, std::memory_order_relaxed);
                }
                for (size_t i = begin; i < end; ++i) ++covered[i];
              });
              int seen = partsMax.load(std::memory_order_relaxed);
              while (parts.load() > seen && !partsMax.compare_exchange_weak(seen, parts.load())) {
              }
              ++passes;
            }
          }
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                        .count();
        }
        const auto [lo, hi] = std::minmax_element(covered.begin(), covered.end());
        py::dict d;
        d["passes"] = passes;
        d["exact"] = bytes == 0 || (*lo == passes && *hi == passes);
        d["cut_on_grain"] = !misCut.load();
        d["most_parts"] = partsMax.load();
        d["seconds"] = seconds;
        return d;
      },
      py::arg("bytes"), py::arg("grain"), py::arg("ways"), py::arg("repeats") = 1);
  // A window all_reduce pass over T threads is priced T^exponent times faster.
  m.def("_thread_exponent", [] { return Registry::get().costModel().threadExponent; });
  m.def("_set_thread_exponent", [](double exponent) {
    if (!(exponent >= 0 && exponent <= 1)) {
      throw std::invalid_argument("the thread exponent must be a number from 0 to 1, got " +
                                  std::to_string(exponent));
    }
    CostModel m = Registry::get().costModel();
    m.threadExponent = exponent;
    Registry::get().setCostModel(m);
  });
  m.def(
      "_algorithm_cost",
      [](const std::string& collective, const std::string& name, double bytes, int world,
         bool oneHost, bool crowded, int passThreads) {
        const Algorithm& a = lookup(collective, name);
        Placement p = Placement::of(oneHost, crowded);
        p.passThreads = std::max(1, passThreads);
        const Cost c = a.cost(bytes, world);
        py::dict d;
        d["steps"] = c.steps;
        d["bytes_moved"] = c.bytesMoved;
        d["bytes_reduced"] = c.bytesReduced;
        d["link"] = linkName(a.link);
        d["priced_on"] = linkName(Registry::pricedOn(a, p));
        // the threads a pass of this size splits over (1 for every other algorithm)
        d["ways"] = a.passWays != nullptr ? a.passWays(bytes, world, p.passThreads) : 1;
        d["seconds"] = Registry::get().predict(a, bytes, world, p, Registry::get().costModel());
        d["unusable"] = Registry::get().unusable(a, bytes, world, p);
        return d;
      },
      py::arg("collective"), py::arg("name"), py::arg("bytes"), py::arg("world"),
      py::arg("one_host") = true, py::arg("crowded") = false, py::arg("pass_threads") = 1);
  m.def(
      "_choose_algorithm",
      [](const std::string& collective, double bytes, int world, bool sameHost, bool oneHost,
         bool crowded, int passThreads) {
        Placement p;
        p.oneHost = oneHost || sameHost;
        p.windows = sameHost;
        p.crowded = p.oneHost && crowded;
        p.passThreads = sameHost ? std::max(1, passThreads) : 1;
        const Choice c = Registry::get().choose(collectiveFromName(collective), bytes, world,
                                                p, Registry::get().costModel());
        return py::make_tuple(c.algorithm->name, c.predicted);
      },
      py::arg("collective"), py::arg("bytes"), py::arg("world"), py::arg("same_host") = true,
      py::arg("one_host") = false, py::arg("crowded") = false, py::arg("pass_threads") = 1);
  m.def(
      "_plan",
      [](const std::string& collective, const std::string& name, int world, int rank,
         size_t count, size_t elemSize, std::vector<size_t> sendBytes,
         std::vector<size_t> recvBytes, int root, size_t chunkBytes) {
        const Algorithm& a = lookup(collective, name);
        if (a.plan == nullptr) throw std::invalid_argument(name + " runs in shared memory, not as a plan");
        PlanArgs args;
        args.rank = rank;
        args.size = world;
        args.count = count;
        args.elemSize = elemSize;
        args.sendBytes = std::move(sendBytes);
        args.recvBytes = std::move(recvBytes);
        args.root = root;
        args.chunkBytes = chunkBytes;
        const Plan plan = a.plan(args);
        py::list steps;
        for (const auto& st : plan.steps) {
          py::list acts;
          for (const auto& act : st.actions) {
            py::dict d;
            d["verb"] = verbName(act.verb);
            d["peer"] = act.peer;
            d["src"] = spanTuple(act.src);
            d["dst"] = spanTuple(act.dst);
            d["segmented"] = act.segmented;
            acts.append(d);
          }
          steps.append(acts);
        }
        return py::make_tuple(steps, plan.scratchBytes);
      },
      py::arg("collective"), py::arg("name"), py::arg("world"), py::arg("rank"),
      py::arg("count") = 0, py::arg("elem_size") = 1, py::arg("send_bytes") = std::vector<size_t>{},
      py::arg("recv_bytes") = std::vector<size_t>{}, py::arg("root") = 0,
      py::arg("chunk_bytes") = 0);
}
