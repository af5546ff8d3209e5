// The algorithm registry and its cost model.
//
// Every algorithm declares the collective it implements, the link it runs on (messages
// over the transport, or a shared-memory window among ranks of one host), its
// constraints, and its cost terms (collectives.h). The predicted time is
//     t = alpha * steps + beta * bytesMoved + gamma * bytesReduced
// with (alpha, beta, gamma) per link, calibrated by `python -m torchdist_ext.bench
// calibrate` or left at defaults. Messages are priced by where the group's ranks are:
// between hosts they cross TCP or RDMA (`net`); among ranks of one host UCX carries them
// through shared memory and cross-memory reads (`local`), whose cost a calibration of
// that host measures, so the two have terms of their own. `auto` picks the cheapest usable algorithm; overrides
// (TDX_ALGO=allreduce:ring,broadcast:tree, or set_algorithm from Python) pin one.
//
// Choices must agree across the ranks of a group: they depend only on the collective,
// the byte count, the world size, the group's placement, the group's cost
// model (rank 0's, shared at group creation) and the overrides (the same on every rank
// by contract, checked with the op fingerprints under TDX_DEBUG=DETAIL).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "algorithms/plan.h"

namespace tdx {
namespace algorithms {

enum class Collective : uint8_t {
  Allreduce,
  Broadcast,
  Reduce,
  Allgather,
  ReduceScatter,
  Alltoall,
  Barrier,
  Gather,
  Scatter,
};
constexpr int kNumCollectives = 9;

// Net: messages over the transport between hosts. Local: the same messages between ranks
// of one host (no algorithm declares it; message algorithms are priced on it when the
// group is on one host). Shm: copies through a shared-memory window. Cma: reads of peers'
// memory in place (process_vm_readv), whose per-byte cost differs from memcpy's (the
// kernel pins pages per call), so it has terms of its own.
enum class Link : uint8_t { Net, Local, Shm, Cma };
constexpr int kNumLinks = 4;

const char* collectiveName(Collective c);
// The name torch.distributed calls it by (all_reduce, all_gather, all_to_all), for errors.
const char* collectiveCallName(Collective c);
// Throws std::invalid_argument listing the valid names.
Collective collectiveFromName(const std::string& name);
const char* linkName(Link l);

struct LinkCost {
  double alpha = 0;  // seconds per step
  double beta = 0;   // seconds per byte moved
  double gamma = 0;  // seconds per byte reduced
};

// Where a group's ranks are, as a measured rule names it (Placement::spread()).
enum class Spread : uint8_t {
  Hosts,    // ranks on several hosts
  Host,     // one host, shared-memory windows off
  Windows,  // one host with its windows
};
constexpr int kNumSpreads = 3;
const char* spreadName(Spread s);
Spread spreadFromName(const std::string& name);

// A measured choice: for this collective, world size, placement, crowding and thread
// count, sizes in [fromBytes, toBytes) run `algorithm`. `python -m torchdist_ext.bench
// tune` times every algorithm where the model's terms cannot be trusted (crowded hosts,
// whose time is the scheduler's as much as the links') and records the fastest where the
// model's pick lost; a rule whose algorithm cannot run an op (a fallback without the
// window, a host without cross-memory attach) is passed over for the next matching rule,
// and the model decides when none is left.
struct Rule {
  Collective collective;
  int world = 0;
  Spread spread = Spread::Windows;
  bool crowded = false;
  // The threads per rank the window all_reduce split its passes over when the rule was
  // measured (Placement::passThreads; 1 without windows): they change its speed several
  // fold on a host with cores to spare, so a ranking measured with one count says
  // nothing about another, and the rule applies only where the group has that count.
  int threads = 1;
  double fromBytes = 0;
  double toBytes = 0;
  std::string algorithm;
};

struct CostModel {
  LinkCost links[kNumLinks];
  std::vector<Rule> rules;
  // Seconds each step of a message algorithm adds on a crowded host (more ranks than
  // cores): a step ends when its peers have run, and with ranks taking turns on the cores
  // that means waiting for the scheduler to wake a peer. TDX_CROWDED_STEP_US; the
  // default is the development VM's (4 ranks, 2 cores), where a chain broadcast's
  // 256 KiB hops took about 200 us each beyond their copies.
  double wake = 0;
  // A window all_reduce pass split over T threads runs T^threadExponent times faster
  // than on one: the threads share the host's memory bandwidth with each other and with
  // the other ranks' threads. The default, 0.5, lies inside what the 16-core GPU host
  // measured (docs/PERFORMANCE.md); `bench calibrate` fits it where the ranks get
  // several threads. 0 to 1.
  double threadExponent = 0.5;
  static CostModel defaults();
  // "net:alpha,beta,gamma;local:...;shm:...;cma:...;wake:seconds;threads:exponent" then one
  // ";rule:collective,world,spread,crowded,from,to,algorithm,threads" per rule, for the
  // store exchange.
  std::string serialize() const;
  static CostModel parse(const std::string& text);
};

// Where a group's ranks are, which decides what may run and what a message costs.
struct Placement {
  bool oneHost = false;     // every rank on one host: messages are priced on Link::Local
  bool windows = false;     // shared-memory algorithms may run (one host, TDX_SHM not 0)
  bool crossMemory = true;  // ranks may read each other's memory (known once the group's
                            // window exists; assumed until then)
  bool crowded = false;     // one host, whose ranks outnumber the CPUs they may run on
                            // together: message steps also pay CostModel::wake
  int passThreads = 1;      // threads each rank splits the window all_reduce's memory
                            // passes over (TDX_SHM_THREADS, as the group settled it)

  // One host with its windows (`sameHost`), or ranks on several hosts.
  static Placement of(bool sameHost, bool crowded = false) {
    return Placement{sameHost, sameHost, true, sameHost && crowded, 1};
  }
  Spread spread() const {
    return !oneHost ? Spread::Hosts : windows ? Spread::Windows : Spread::Host;
  }
  // The same ranks when the window is missing: a group whose windows are off, with no
  // threads for a window all_reduce (so the rules measured that way apply).
  Placement withoutWindows() const {
    Placement p = *this;
    p.windows = false;
    p.passThreads = 1;
    return p;
  }
};

struct Algorithm {
  Collective collective;
  const char* name;
  Link link;
  bool powerOfTwoOnly;
  // Largest bytes * world the algorithm takes (0: no limit); direct all_reduce holds
  // every rank's buffer in scratch.
  double maxBytesTimesWorld;
  // Reads peers' buffers in place (cross-memory attach), which the host may forbid.
  bool needsCrossMemory;
  Plan (*plan)(const PlanArgs&);  // null for shared-memory algorithms
  Cost (*cost)(double bytes, int n);
  const char* summary;
  // For an algorithm that splits its memory passes over Placement::passThreads threads
  // per rank: how many threads a pass of an op of `bytes` really splits over, which the
  // model prices as a speedup of its byte terms (Registry::predict). Null: one thread.
  int (*passWays)(double bytes, int n, int threads) = nullptr;
};

// The pinned algorithm of each collective ("" for auto), as of one moment: an op runs
// with the pins in force when it was issued, which every rank issued in the same order.
using Pins = std::array<std::string, kNumCollectives>;

// A pinned algorithm that cannot run an op. Every rank of a group refuses alike (same
// pins by contract, same bytes, same placement) before any of the op's transfers, so the
// op fails and the group stays usable.
struct PinRefused : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct Choice {
  const Algorithm* algorithm = nullptr;
  double predicted = 0;  // seconds
  bool pinned = false;   // chosen by an override
  bool measured = false;  // chosen by a measured rule (CostModel::rules)
};

class Registry {
 public:
  static Registry& get();

  const std::vector<Algorithm>& all() const {
    return algorithms_;
  }
  const Algorithm* find(Collective c, const std::string& name) const;

  // Why `a` cannot run this op ("" when it can).
  std::string unusable(const Algorithm& a, double bytes, int n, const Placement& p) const;
  // The link whose terms price `a` in a group placed as `p`.
  static Link pricedOn(const Algorithm& a, const Placement& p);
  double predict(const Algorithm& a, double bytes, int n, const Placement& p,
                 const CostModel& model) const;

  // The algorithm for an op; throws PinRefused when a pinned algorithm cannot run it
  // (naming why and what can).
  // `pins`: the pins to obey (an op's snapshot); null for the ones in force now.
  Choice choose(Collective c, double bytes, int n, const Placement& p, const CostModel& model,
                const Pins* pins = nullptr) const;
  // What `auto` picks, ignoring overrides: the algorithm of the model's first matching
  // rule when it can run the op, else the cheapest usable one; optionally restricted to
  // algorithms declaring one link.
  Choice cheapest(Collective c, double bytes, int n, const Placement& p, const CostModel& model,
                  const Link* only = nullptr) const;

  // "auto" clears the override. Throws std::invalid_argument for unknown names.
  void setOverride(Collective c, const std::string& name);
  std::string override(Collective c) const;
  // The pins in force now; shared, not copied (a new snapshot replaces it on each change).
  std::shared_ptr<const Pins> pins() const;
  // Every pinned algorithm of `pins` (default: those in force now),
  // "allreduce:ring,broadcast:tree" ("" when none), so ranks can compare their pins.
  std::string overrides(const Pins* pins = nullptr) const;
  // TDX_ALGO syntax: "allreduce:ring,broadcast:tree".
  void applyOverrides(const std::string& spec);

  // The process's cost model (calibration or defaults); groups take rank 0's copy.
  CostModel costModel() const;
  void setCostModel(const CostModel& m);
  // Throws std::invalid_argument naming what is wrong with `r` (an unknown algorithm,
  // a world below 1, an empty or negative size range).
  void checkRule(const Rule& r) const;

 private:
  Registry();
  std::vector<Algorithm> algorithms_;
  mutable std::mutex mu_;
  std::shared_ptr<const Pins> pins_ = std::make_shared<const Pins>();  // under mu_
  CostModel model_;
};

} // namespace algorithms
} // namespace tdx
