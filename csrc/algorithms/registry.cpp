#include "algorithms/registry.h"

#include <cmath>
#include <limits>
#include <locale>
#include <sstream>
#include <stdexcept>

#include "algorithms/collectives.h"
#include "algorithms/pass_pool.h"
#include "algorithms/shm_collectives.h"
#include "common/env.h"

namespace tdx {
namespace algorithms {

namespace {

const char* const kCollectiveNames[kNumCollectives] = {
    "allreduce", "broadcast", "reduce",  "allgather", "reduce_scatter",
    "alltoall",  "barrier",   "gather",  "scatter"};
// As torch.distributed spells them: three with an underscore (dist.all_reduce). Users
// write those names into TDX_ALGO and set_algorithm, so both spellings are accepted.
const char* const kCollectiveCallNames[kNumCollectives] = {
    "all_reduce", "broadcast", "reduce",  "all_gather", "reduce_scatter",
    "all_to_all", "barrier",   "gather",  "scatter"};

} // namespace

const char* collectiveName(Collective c) {
  return kCollectiveNames[static_cast<int>(c)];
}

const char* collectiveCallName(Collective c) {
  return kCollectiveCallNames[static_cast<int>(c)];
}

Collective collectiveFromName(const std::string& name) {
  for (int i = 0; i < kNumCollectives; ++i) {
    if (name == kCollectiveNames[i] || name == kCollectiveCallNames[i]) {
      return static_cast<Collective>(i);
    }
  }
  std::string all;
  for (int i = 0; i < kNumCollectives; ++i) all += (i ? ", " : "") + std::string(kCollectiveNames[i]);
  throw std::invalid_argument("unknown collective '" + name + "'; use one of " + all);
}

const char* linkName(Link l) {
  switch (l) {
    case Link::Net:
      return "net";
    case Link::Local:
      return "local";
    case Link::Shm:
      return "shm";
    case Link::Cma:
      return "cma";
  }
  return "?";
}

namespace {

const char* const kSpreadNames[kNumSpreads] = {"hosts", "host", "windows"};

// Largest world size a rule may name.
constexpr int kMaxRuleWorld = 1 << 24;

std::string formatDouble(double v) {
  std::ostringstream os;
  os.imbue(std::locale::classic());  // no digit grouping: ',' separates a rule's fields
  os.precision(17);
  os << v;
  return os.str();
}

double parseDouble(const std::string& text, const std::string& entry) {
  // The classic locale, as serialize() writes: a rank whose program set a decimal-comma
  // locale must read what rank 0 wrote. A stream, not stod: stod throws on the ERANGE
  // of subnormal values, which the writing rank accepted.
  if (text == "inf") return std::numeric_limits<double>::infinity();
  std::istringstream is(text);
  is.imbue(std::locale::classic());
  double v = 0;
  is >> v;
  if (!text.empty() && !is.fail() && is.eof()) return v;
  if (is.fail() && !text.empty() && text.find_first_not_of("0123456789.e-+") == std::string::npos) {
    // Out of range (a subnormal, or beyond double) sets failbit: every rank parses the
    // same text here, so any fixed answer agrees; an underflow is as good as zero.
    return text.find("e-") != std::string::npos ? 0.0 : std::numeric_limits<double>::infinity();
  }
  throw std::invalid_argument("bad cost model entry '" + entry + "': '" + text +
                              "' is not a number");
}

// "collective,world,spread,crowded,from,to,algorithm,threads", as serialize() writes it.
Rule parseRule(const std::string& text, const std::string& entry) {
  std::vector<std::string> f;
  std::stringstream ss(text);
  std::string field;
  while (std::getline(ss, field, ',')) f.push_back(field);
  if (f.size() != 8) {
    throw std::invalid_argument(
        "bad cost model entry '" + entry +
        "': a rule is collective,world,spread,crowded,from,to,algorithm,threads");
  }
  Rule r;
  r.collective = collectiveFromName(f[0]);
  const double world = parseDouble(f[1], entry);
  if (!(world >= 1 && world <= kMaxRuleWorld) || world != static_cast<int>(world)) {
    throw std::invalid_argument("bad cost model entry '" + entry +
                                "': the world size is a whole number from 1");
  }
  r.world = static_cast<int>(world);
  r.spread = spreadFromName(f[2]);
  if (f[3] != "0" && f[3] != "1") {
    throw std::invalid_argument("bad cost model entry '" + entry + "': crowded is 0 or 1");
  }
  r.crowded = f[3] == "1";
  r.fromBytes = parseDouble(f[4], entry);
  r.toBytes = parseDouble(f[5], entry);
  r.algorithm = f[6];
  const double threads = parseDouble(f[7], entry);
  if (!(threads >= 1 && threads <= kMaxPassThreads) || threads != static_cast<int>(threads)) {
    throw std::invalid_argument("bad cost model entry '" + entry +
                                "': the thread count is a whole number from 1 to " +
                                std::to_string(kMaxPassThreads));
  }
  r.threads = static_cast<int>(threads);
  return r;
}

} // namespace

const char* spreadName(Spread s) {
  return kSpreadNames[static_cast<int>(s)];
}

Spread spreadFromName(const std::string& name) {
  for (int i = 0; i < kNumSpreads; ++i) {
    if (name == kSpreadNames[i]) return static_cast<Spread>(i);
  }
  throw std::invalid_argument("unknown placement '" + name +
                              "'; use hosts (ranks on several hosts), host (one host, "
                              "windows off) or windows (one host with its windows)");
}

CostModel CostModel::defaults() {
  // Rough figures for TCP loopback / a NIC (net) and memory copies (shm) on a current
  // server; `bench calibrate` replaces them with this machine's.
  CostModel m;
  m.links[static_cast<int>(Link::Net)] = {30e-6, 1.0 / 1.5e9, 1.0 / 3e9};
  // Same-host messages move bytes faster than TCP, but the message algorithms pay more
  // than bytes over UCX's shared memory: rendezvous handshakes, a reduction per received
  // segment, a wake-up per step. Against the window terms below, every lower beta tried
  // on the development VM's measured points (2 ranks, 4 KiB-64 MiB, six collectives)
  // picked worse, so local starts at net's terms and a calibration fits its own.
  m.links[static_cast<int>(Link::Local)] = m.links[static_cast<int>(Link::Net)];
  m.links[static_cast<int>(Link::Shm)] = {3e-6, 1.0 / 5e9, 1.0 / 3e9};
  // Measured on the development VM: cross-memory reads ran at about a third of memcpy.
  m.links[static_cast<int>(Link::Cma)] = {5e-6, 1.0 / 2.5e9, 1.0 / 3e9};
  const int64_t wakeUs = env::getInt("TDX_CROWDED_STEP_US");
  if (wakeUs < 0) {
    throw std::invalid_argument("TDX_CROWDED_STEP_US=" + std::to_string(wakeUs) +
                                " is negative; give microseconds >= 0 (0: no charge)");
  }
  m.wake = static_cast<double>(wakeUs) * 1e-6;
  return m;
}

std::string CostModel::serialize() const {
  std::ostringstream os;
  os.imbue(std::locale::classic());
  os.precision(17);
  for (int i = 0; i < kNumLinks; ++i) {
    os << (i ? ";" : "") << linkName(static_cast<Link>(i)) << ":" << links[i].alpha << ","
       << links[i].beta << "," << links[i].gamma;
  }
  os << ";wake:" << wake << ";threads:" << threadExponent;
  for (const Rule& r : rules) {
    os << ";rule:" << collectiveName(r.collective) << "," << r.world << ","
       << spreadName(r.spread) << "," << (r.crowded ? 1 : 0) << "," << formatDouble(r.fromBytes)
       << "," << formatDouble(r.toBytes) << "," << r.algorithm << "," << r.threads;
  }
  return os.str();
}

CostModel CostModel::parse(const std::string& text) {
  CostModel m = defaults();
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ';')) {
    const auto colon = part.find(':');
    if (colon == std::string::npos) continue;
    const std::string link = part.substr(0, colon);
    if (link == "wake") {
      m.wake = parseDouble(part.substr(colon + 1), part);
      if (!(m.wake >= 0)) {
        throw std::invalid_argument("bad cost model entry '" + part + "'");
      }
      continue;
    }
    if (link == "threads") {
      m.threadExponent = parseDouble(part.substr(colon + 1), part);
      if (!(m.threadExponent >= 0 && m.threadExponent <= 1)) {
        throw std::invalid_argument("bad cost model entry '" + part +
                                    "': the thread exponent is 0 to 1");
      }
      continue;
    }
    if (link == "rule") {
      Rule r = parseRule(part.substr(colon + 1), part);
      Registry::get().checkRule(r);
      m.rules.push_back(std::move(r));
      continue;
    }
    std::vector<std::string> terms;
    std::stringstream fields(part.substr(colon + 1));
    std::string field;
    while (std::getline(fields, field, ',')) terms.push_back(field);
    if (terms.size() != 3) throw std::invalid_argument("bad cost model entry '" + part + "'");
    const double a = parseDouble(terms[0], part), b = parseDouble(terms[1], part),
                 g = parseDouble(terms[2], part);
    for (int i = 0; i < kNumLinks; ++i) {
      if (link == linkName(static_cast<Link>(i))) m.links[i] = {a, b, g};
    }
  }
  return m;
}

Registry& Registry::get() {
  static Registry r;
  return r;
}

Registry::Registry() : model_(CostModel::defaults()) {
  using C = Collective;
  using L = Link;
  const double noLimit = 0;  // maxBytesTimesWorld: no scratch limit
  algorithms_ = {
      {C::Allreduce, "ring", L::Net, false, noLimit, false, ringAllreducePlan, ringAllreduceCost,
       "reduce-scatter + all-gather around a ring; bandwidth-optimal, 2(N-1) steps"},
      {C::Allreduce, "rhd", L::Net, false, noLimit, false, rhdAllreducePlan, rhdAllreduceCost,
       "recursive halving-doubling (Rabenseifner), fold-in/out for non-powers of two"},
      {C::Allreduce, "direct", L::Net, false, 64.0 * (1 << 20), false, directAllreducePlan,
       directAllreduceCost, "one step: everyone sends everything to everyone"},
      {C::Allreduce, "shm", L::Shm, false, noLimit, false, nullptr, shmAllreduceCost,
       "same host: reduce-scatter + all-gather through a shared-memory window",
       shmAllreduceWays},
      {C::Allreduce, "cma", L::Cma, false, noLimit, true, nullptr, cmaAllreduceCost,
       "same host: ranks read each other's buffers in place (process_vm_readv), 3 signals",
       cmaAllreduceWays},
      {C::Allreduce, "shm_direct", L::Shm, false, noLimit, false, nullptr, shmDirectAllreduceCost,
       "same host: every rank reduces every slot of a shared-memory window"},
      {C::Broadcast, "tree", L::Net, false, noLimit, false, treeBroadcastPlan, treeBroadcastCost,
       "binomial tree, ceil(log2 N) steps"},
      {C::Broadcast, "chain", L::Net, false, noLimit, false, chainBroadcastPlan, chainBroadcastCost,
       "pipelined chain: chunks flow rank to rank, every link carries S once"},
      {C::Broadcast, "shm", L::Shm, false, noLimit, false, nullptr, shmBroadcastCost,
       "same host: the root's slot, read by every rank"},
      {C::Reduce, "tree", L::Net, false, noLimit, false, treeReducePlan, treeReduceCost,
       "binomial tree, ceil(log2 N) steps"},
      {C::Reduce, "shm", L::Shm, false, noLimit, false, nullptr, shmReduceCost,
       "same host: ranks reduce 1/N each through a shared-memory window"},
      {C::Reduce, "shm_direct", L::Shm, false, noLimit, false, nullptr, shmDirectReduceCost,
       "same host: the root reduces every rank's slot of a shared-memory window itself"},
      {C::Allgather, "ring", L::Net, false, noLimit, false, ringAllgatherPlan, ringAllgatherCost,
       "ring, N-1 steps, any block sizes"},
      {C::Allgather, "rd", L::Net, true, noLimit, false, rdAllgatherPlan, rdAllgatherCost,
       "recursive doubling, log2 N steps (power-of-two worlds)"},
      {C::Allgather, "shm", L::Shm, false, noLimit, false, nullptr, shmAllgatherCost,
       "same host: every rank reads every slot"},
      {C::ReduceScatter, "ring", L::Net, false, noLimit, false, ringReduceScatterPlan,
       ringReduceScatterCost, "ring, N-1 steps"},
      {C::ReduceScatter, "rh", L::Net, true, noLimit, false, rhReduceScatterPlan, rhReduceScatterCost,
       "recursive halving, log2 N steps (power-of-two worlds)"},
      {C::ReduceScatter, "shm", L::Shm, false, noLimit, false, nullptr, shmReduceScatterCost,
       "same host: each rank reduces its block from every slot"},
      {C::Alltoall, "pairwise", L::Net, false, noLimit, false, pairwiseAlltoallPlan, pairwiseAlltoallCost,
       "pairwise exchange, N-1 steps, uneven splits"},
      {C::Alltoall, "shm", L::Shm, false, noLimit, false, nullptr, shmAlltoallCost,
       "same host: every rank reads its block from every slot"},
      {C::Barrier, "dissemination", L::Net, false, noLimit, false, disseminationBarrierPlan,
       disseminationBarrierCost, "dissemination, ceil(log2 N) rounds of empty messages"},
      {C::Barrier, "shm", L::Shm, false, noLimit, false, nullptr, shmBarrierCost,
       "same host: one signal through a shared-memory window"},
      {C::Gather, "direct", L::Net, false, noLimit, false, directGatherPlan, directGatherScatterCost,
       "every rank sends to the root in one step"},
      {C::Gather, "shm", L::Shm, false, noLimit, false, nullptr, shmGatherScatterCost,
       "same host: the root reads every slot"},
      {C::Scatter, "direct", L::Net, false, noLimit, false, directScatterPlan, directGatherScatterCost,
       "the root sends to every rank in one step"},
      {C::Scatter, "shm", L::Shm, false, noLimit, false, nullptr, shmGatherScatterCost,
       "same host: every rank reads its block from the root's slot"},
  };
  applyOverrides(env::get("TDX_ALGO"));
}

const Algorithm* Registry::find(Collective c, const std::string& name) const {
  for (const auto& a : algorithms_) {
    if (a.collective == c && name == a.name) return &a;
  }
  return nullptr;
}

std::string Registry::unusable(const Algorithm& a, double bytes, int n,
                               const Placement& p) const {
  if (a.powerOfTwoOnly && !isPowerOfTwo(n)) {
    return "needs a power-of-two world size, this group has " + std::to_string(n) + " ranks";
  }
  if (a.link != Link::Net && !p.windows) {
    return p.oneHost ? "needs the group's shared-memory window, which TDX_SHM=0 turns off"
                     : "needs every rank of the group on one host";
  }
  if (a.needsCrossMemory && !p.crossMemory) {
    return "needs cross-memory attach (process_vm_readv), which this host does not allow "
           "between the group's ranks (Yama ptrace_scope, seccomp)";
  }
  if (a.maxBytesTimesWorld > 0 && bytes * n > a.maxBytesTimesWorld) {
    // The limit is on the product: name both factors and the sizes that would fit.
    const auto whole = [](double v) { return std::to_string(static_cast<long long>(v)); };
    return "holds every rank's buffer in scratch: " + whole(bytes) + " bytes x " +
           std::to_string(n) + " ranks = " + whole(bytes * n) + " bytes, over its limit of " +
           whole(a.maxBytesTimesWorld) + " (at most " + whole(a.maxBytesTimesWorld / n) +
           " bytes per rank at this world size)";
  }
  return "";
}

Link Registry::pricedOn(const Algorithm& a, const Placement& p) {
  return a.link == Link::Net && p.oneHost ? Link::Local : a.link;
}

double Registry::predict(const Algorithm& a, double bytes, int n, const Placement& p,
                         const CostModel& model) const {
  const Cost c = a.cost(bytes, n);
  const Link link = pricedOn(a, p);
  const LinkCost& l = model.links[static_cast<int>(link)];
  // Only messages pay the wake-ups: a window algorithm's steps are a few signals, and
  // what the development VM measured is the message hops' (priced as if uncrowded, a
  // chain broadcast was picked from 1 MiB and lost to the tree by 1.2-3.7x from 4 MiB
  // at 3 and 4 ranks on 2 cores).
  const double alpha = l.alpha + (p.crowded && link == Link::Local ? model.wake : 0.0);
  // Threads share the host's memory bandwidth with each other and with the other ranks'
  // threads, so t threads do not make a pass t times faster but t^threadExponent. On the
  // 16-core GPU host (docs/PERFORMANCE.md) 4 threads per rank made the 16 MiB all_reduce
  // 3.4x faster at 2 ranks and 1.8x at 4, 8 threads 2.8x at 2 ranks; the default
  // exponent, 0.5 (2 for 4 threads and 2.8 for 8), lies within that spread. t counts only
  // the threads a pass of this size really splits over. The terms calibrate with one
  // thread (`bench calibrate` sets it), so the speedup is not counted twice. The cma
  // all_reduce's split reads take the same exponent, fitted on the window's passes: a
  // kernel copy per block shares the same memory.
  const int ways = a.passWays != nullptr ? a.passWays(bytes, n, p.passThreads) : 1;
  const double split = std::pow(static_cast<double>(ways), model.threadExponent);
  return alpha * c.steps + (l.beta * c.bytesMoved + l.gamma * c.bytesReduced) / split;
}

Choice Registry::cheapest(Collective c, double bytes, int n, const Placement& p,
                          const CostModel& model, const Link* only) const {
  const Spread spread = p.spread();
  for (const Rule& r : model.rules) {
    if (r.collective != c || r.world != n || r.spread != spread || r.crowded != p.crowded ||
        r.threads != p.passThreads || bytes < r.fromBytes || bytes >= r.toBytes) {
      continue;
    }
    const Algorithm* a = find(c, r.algorithm);
    if (a == nullptr || (only && a->link != *only) || !unusable(*a, bytes, n, p).empty()) {
      continue;
    }
    return Choice{a, predict(*a, bytes, n, p, model), false, true};
  }
  Choice best;
  best.predicted = std::numeric_limits<double>::infinity();
  for (const auto& a : algorithms_) {
    if (a.collective != c || (only && a.link != *only)) continue;
    if (!unusable(a, bytes, n, p).empty()) continue;
    const double t = predict(a, bytes, n, p, model);
    // Ties (e.g. one rank, where every algorithm costs nothing) go to the first listed.
    if (best.algorithm == nullptr || t < best.predicted) {
      best.algorithm = &a;
      best.predicted = t;
    }
  }
  return best;
}

Choice Registry::choose(Collective c, double bytes, int n, const Placement& p,
                        const CostModel& model, const Pins* pins) const {
  const std::string pinned = pins ? (*pins)[static_cast<int>(c)] : override(c);
  if (pinned.empty()) return cheapest(c, bytes, n, p, model);
  const Algorithm* a = find(c, pinned);
  const std::string why = unusable(*a, bytes, n, p);
  if (!why.empty()) {
    throw PinRefused(std::string(collectiveName(c)) + " is pinned to '" + pinned +
                                "', which " + why +
                                "; pin another (torchdist_ext.algorithms() lists them) or "
                                "set it back to 'auto'");
  }
  return Choice{a, predict(*a, bytes, n, p, model), true};
}

void Registry::setOverride(Collective c, const std::string& name) {
  if (name != "auto" && !name.empty() && find(c, name) == nullptr) {
    std::string names;
    for (const auto& a : algorithms_) {
      if (a.collective == c) names += std::string(names.empty() ? "" : ", ") + a.name;
    }
    throw std::invalid_argument("unknown " + std::string(collectiveName(c)) + " algorithm '" +
                                name + "'; use auto or one of " + names);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto next = std::make_shared<Pins>(*pins_);  // ops issued before keep the old snapshot
  (*next)[static_cast<int>(c)] = name == "auto" ? "" : name;
  pins_ = std::move(next);
}

std::string Registry::override(Collective c) const {
  return (*pins())[static_cast<int>(c)];
}

std::shared_ptr<const Pins> Registry::pins() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pins_;
}

std::string Registry::overrides(const Pins* pins) const {
  std::shared_ptr<const Pins> now;
  if (pins == nullptr) {
    now = this->pins();
    pins = now.get();
  }
  std::string out;
  for (int i = 0; i < kNumCollectives; ++i) {
    const std::string& name = (*pins)[i];
    if (name.empty()) continue;
    out += (out.empty() ? "" : ",") + std::string(kCollectiveNames[i]) + ":" + name;
  }
  return out;
}

void Registry::applyOverrides(const std::string& spec) {
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw std::invalid_argument("TDX_ALGO entry '" + item +
                                  "' must be collective:algorithm, e.g. allreduce:ring");
    }
    setOverride(collectiveFromName(item.substr(0, colon)), item.substr(colon + 1));
  }
}

CostModel Registry::costModel() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_;
}

void Registry::setCostModel(const CostModel& m) {
  for (const Rule& r : m.rules) checkRule(r);
  std::lock_guard<std::mutex> lock(mu_);
  model_ = m;
}

void Registry::checkRule(const Rule& r) const {
  const std::string what = std::string("rule for ") + collectiveName(r.collective) + " at world " +
                           std::to_string(r.world) + ": ";
  if (find(r.collective, r.algorithm) == nullptr) {
    std::string names;
    for (const auto& a : algorithms_) {
      if (a.collective == r.collective) names += std::string(names.empty() ? "" : ", ") + a.name;
    }
    throw std::invalid_argument(what + "unknown algorithm '" + r.algorithm + "'; use one of " +
                                names);
  }
  if (r.world < 1 || r.world > kMaxRuleWorld) {
    throw std::invalid_argument(what + "the world size must be 1 to " +
                                std::to_string(kMaxRuleWorld));
  }
  if (r.threads < 1 || r.threads > kMaxPassThreads) {
    throw std::invalid_argument(what + "the thread count must be 1 to " +
                                std::to_string(kMaxPassThreads) + ", got " +
                                std::to_string(r.threads));
  }
  if (r.threads != 1 && r.spread != Spread::Windows) {
    // Only the window all_reduce splits its passes: elsewhere a group has 1 thread, and a
    // rule for more would never apply.
    throw std::invalid_argument(what + "placement " + spreadName(r.spread) + " runs 1 thread "
                                "per rank; only windows may name " + std::to_string(r.threads));
  }
  if (!(r.fromBytes >= 0) || !(r.toBytes > r.fromBytes)) {
    throw std::invalid_argument(what + "needs 0 <= from_bytes < to_bytes, got " +
                                formatDouble(r.fromBytes) + " and " + formatDouble(r.toBytes));
  }
}

} // namespace algorithms
} // namespace tdx
