// Construction, the worker thread, point-to-point, coalescing, splitting and teardown.
// The collectives themselves are in Collectives.cpp.
#include "c10d/ProcessGroupTDX.hpp"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <pybind11/pybind11.h>

#include <torch/csrc/distributed/c10d/debug.h>

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include "algorithms/collectives.h"
#include "algorithms/executor.h"
#include "algorithms/pass_pool.h"

#include "c10d/StoreGeneration.hpp"
#include "c10d/Validation.hpp"
#include "common/env.h"
#include "common/host.h"
#include "common/logging.h"
#include "transport/process_watch.h"
#include "transport/tag.h"

namespace tdx {

using transport::Clock;

namespace {

// Root and reduce op of the next enqueue() on this thread, for its fingerprint. Set by
// the op methods right before they enqueue; thread_local so concurrent callers on other
// threads cannot mix them up.
thread_local std::string tFingerprintExtra;
// The same op's detail code and root for its tags (GroupChannel::setDetailCode).
thread_local uint32_t tDetailCode = 0;
thread_local int tDetailRoot = -1;

bool shapesMustMatch(c10d::OpType t) {
  switch (t) {
    case c10d::OpType::ALLTOALL:
    case c10d::OpType::ALLTOALL_BASE:  // uneven splits differ by rank
    case c10d::OpType::GATHER:         // only the root passes a list
    case c10d::OpType::SCATTER:
    case c10d::OpType::BARRIER:
      return false;
    default:
      return true;
  }
}

// The collective an OpType is on the wire; COALESCED covers several, so its callers say.
std::optional<algorithms::Collective> collectiveOf(c10d::OpType type) {
  using algorithms::Collective;
  switch (type) {
    case c10d::OpType::BROADCAST:
      return Collective::Broadcast;
    case c10d::OpType::ALLREDUCE:
    case c10d::OpType::ALLREDUCE_COALESCED:
      return Collective::Allreduce;
    case c10d::OpType::REDUCE:
      return Collective::Reduce;
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE:
    case c10d::OpType::ALLGATHER_COALESCED:
      return Collective::Allgather;
    case c10d::OpType::GATHER:
      return Collective::Gather;
    case c10d::OpType::SCATTER:
      return Collective::Scatter;
    case c10d::OpType::REDUCE_SCATTER:
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return Collective::ReduceScatter;
    case c10d::OpType::ALLTOALL:
    case c10d::OpType::ALLTOALL_BASE:
      return Collective::Alltoall;
    case c10d::OpType::BARRIER:
      return Collective::Barrier;
    default:
      return std::nullopt;
  }
}

std::string fingerprintOf(c10d::OpType type, const std::string& what,
                          const std::vector<at::Tensor>& tensors, const std::string& extra) {
  std::ostringstream os;
  os << what;
  const at::Tensor* first = nullptr;
  for (const auto& t : tensors) {
    if (t.defined()) {
      first = &t;
      break;
    }
  }
  // A complex all_reduce reaches the backend as torch's real view from dist.all_reduce,
  // and as the complex tensor itself from all_reduce_into: the same op, counted alike.
  const bool asReal = type == c10d::OpType::ALLREDUCE && first && first->is_complex();
  if (first) {
    os << " dtype="
       << (asReal ? c10::toRealValueType(first->scalar_type()) : first->scalar_type());
  }
  if (type == c10d::OpType::ALLREDUCE) {
    // Element-wise over the flat data: only the count must agree, so all_reduce and
    // all_reduce_into (whose output may be shaped apart from its input) can meet.
    if (first) os << " numel=" << first->numel() * (asReal ? 2 : 1);
  } else if (shapesMustMatch(type)) {
    os << " shapes=";
    for (const auto& t : tensors) {
      if (t.defined()) os << t.sizes();
    }
  }
  os << extra;
  return os.str();
}

// How often a shutdown's goodbye wait looks for an abort() from another thread.
constexpr std::chrono::milliseconds kAbortPoll{50};
// CPUs per rank of this host's ranks of the default group (their masks together, within
// their cgroups, over their count), the most a subgroup's rank may fill with threads; 0
// before a tdx default group exists. The same on every process of the host.
std::atomic<int>& jobCpusPerRank() {
  static std::atomic<int> share{0};
  return share;
}

// Polls `store` until it holds every key of `keys`, calling stop() after each pause: it
// throws to give up, or returns true to end the wait early. Polled, not waited on: a
// TCPStore logs a warning for each wait that times out, and a store that fails (or is
// gone) raises at once rather than being retried. The pause doubles from 1 ms to `longest`.
template <class Stop>
void pollStore(c10d::Store& store, const std::vector<std::string>& keys,
               std::chrono::milliseconds longest, const Stop& stop) {
  for (std::chrono::milliseconds pause{1};; pause = std::min(pause * 2, longest)) {
    if (store.check(keys)) return;
    std::this_thread::sleep_for(pause);
    if (stop()) return;
  }
}

// Global rank -> endpoint of the process's transport, as its groups connected them.
// Connections are per peer process and shared by the groups, so a group being set up can
// tell a member that another group already saw die, before it has connected itself.
struct KnownPeers {
  std::mutex mu;
  std::weak_ptr<transport::UcxTransport> transport;  // the endpoints' (a re-init starts anew)
  std::unordered_map<int64_t, int> endpointOf;

  void add(const std::shared_ptr<transport::UcxTransport>& t, int64_t globalRank, int endpoint) {
    std::lock_guard<std::mutex> lock(mu);
    if (transport.lock() != t) {
      transport = t;
      endpointOf.clear();
    }
    endpointOf[globalRank] = endpoint;
  }
  bool lost(int64_t globalRank) {
    std::lock_guard<std::mutex> lock(mu);
    const auto t = transport.lock();
    const auto it = endpointOf.find(globalRank);
    return t && it != endpointOf.end() && t->endpointFailed(it->second);
  }
};
KnownPeers& knownPeers() {
  static auto* peers = new KnownPeers;  // never destroyed: groups may outlive statics
  return *peers;
}

// Bytes of the distinct storages of `tensors`, for what a hold keeps: an in-place op
// lists its tensor twice, and a view keeps its whole storage.
size_t storageBytes(const std::vector<at::Tensor>& tensors) {
  std::vector<const c10::StorageImpl*> seen;
  size_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) continue;
    seen.push_back(s);
    bytes += s->nbytes();
  }
  return bytes;
}

// The element size the tensors of an op share (GroupChannel::setElementBytes), or 0 when
// they have different dtypes or there are none.
size_t commonElementBytes(const std::vector<at::Tensor>& tensors) {
  std::optional<at::ScalarType> dtype;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    if (dtype && *dtype != t.scalar_type()) return 0;
    dtype = t.scalar_type();
  }
  return dtype ? c10::elementSize(*dtype) : 0;
}

// "0, 2, 5": a group's global ranks, the first 16 of them.
std::string memberList(const std::vector<int64_t>& globalRanks) {
  constexpr size_t kListed = 16;
  std::string list;
  for (size_t r = 0; r < std::min(globalRanks.size(), kListed); ++r) {
    list += (r ? ", " : "") + std::to_string(globalRanks[r]);
  }
  if (globalRanks.size() > kListed) {
    list += ", ... (torch.distributed.get_global_rank maps the rest)";
  }
  return list;
}

// A group's timeout bounds every op: zero or less would fail any op that waits at all,
// at random, depending on which rank came first.
void checkTimeout(const std::string& prefix, std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(timeout.count() > 0, prefix, ": the timeout must be positive, got ",
                    timeout.count(), " ms; for no practical limit pass a long one, such as "
                    "timedelta(days=365)");
}

// TDX_SHM_THREADS: 1 to 16, or 0 for auto. Throws naming the group on anything else.
int shmThreadsSetting(const std::string& prefix) {
  if (env::get("TDX_SHM_THREADS") == "auto") return 0;
  const int64_t threads = env::getInt("TDX_SHM_THREADS");
  TORCH_CHECK_VALUE(threads >= 1 && threads <= algorithms::kMaxPassThreads, prefix,
                    ": TDX_SHM_THREADS must be auto or 1 to ", algorithms::kMaxPassThreads,
                    ", got ", threads);
  return static_cast<int>(threads);
}

// On the 16-core GPU host (docs/PERFORMANCE.md) 2 ranks still gained from 4 to 8 threads
// each from 64 MiB on; 8 is the most measured.
constexpr int kAutoPassThreads = 8;

// How long a shutdown that waits for no peer gives its own goodbyes to go out.
constexpr std::chrono::milliseconds kGoodbyeSendWait{1000};
// How long such a shutdown (unless abort() was called) still listens for live peers'
// goodbyes. The members of a broken group shut it down at about the same time, and one
// that stopped its transport before a peer's goodbye came leaves that peer sending to
// shared memory it has removed (UCX logs "shmat failed" there); one that came after the
// receive was cancelled waits unmatched in this rank's worker until the transport stops
// (and is counted there: StopReportsCounter). Short, as such a peer may be stuck in an
// op that waits for this rank.
constexpr std::chrono::milliseconds kGoodbyeCourtesyWait{100};

// A point-to-point message's header under fingerprint checks: the sender's dtype and
// shape as text, NUL-padded.
constexpr size_t kP2pHeaderBytes = 128;

std::string p2pFingerprint(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes();
  return os.str().substr(0, kP2pHeaderBytes - 1);
}

// The sender's fingerprint at the start of a received message; never reads past the
// header, whatever the sender wrote there.
std::string p2pHeaderText(const at::Tensor& wire) {
  const char* h = static_cast<const char*>(wire.data_ptr());
  return std::string(h, strnlen(h, kP2pHeaderBytes));
}

uint32_t hashGroupName(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<uint32_t>((h ^ (h >> 20) ^ (h >> 40)) & tag::kGroupMask);
}

// The group ids this process holds. A group's id is in every tag it sends, and the tag
// field has 20 bits, so hashes of two names can collide: two live groups sharing an id
// and a pair of members would take each other's messages. An id also stays held for a
// while after its group is destroyed, since a message sent to that group and never
// received may still wait in the transport. Each group picks the first of a few hashes
// of its name that every member has free.
class GroupIds {
 public:
  static constexpr int kCandidates = 64;
  static constexpr size_t kRetired = 32;  // destroyed groups whose ids stay held

  static GroupIds& get() {
    static GroupIds ids;
    return ids;
  }

  static std::vector<uint32_t> candidates(const std::string& name) {
    std::vector<uint32_t> c(kCandidates);
    c[0] = hashGroupName(name);
    for (int k = 1; k < kCandidates; ++k) c[k] = hashGroupName(name + "#" + std::to_string(k));
    return c;
  }

  // Holds every free candidate (so a group created meanwhile on another thread cannot
  // take one) and returns which were free, a bit per candidate.
  uint64_t reserve(const std::vector<uint32_t>& c) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t mask = 0;
    for (int k = 0; k < kCandidates; ++k) {
      if (held_.insert(c[k]).second) mask |= uint64_t{1} << k;
    }
    return mask;
  }

  // Keeps candidate `chosen` (-1: none) and gives back the others `reserve` held.
  void settle(const std::vector<uint32_t>& c, uint64_t reserved, int chosen) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int k = 0; k < kCandidates; ++k) {
      if (k != chosen && (reserved >> k & 1)) held_.erase(c[k]);
    }
  }

  // A destroyed group's id, held until kRetired later groups have been destroyed.
  // `forGood`: held for the life of the process instead, as messages sent to the group
  // may wait in a transport that outlives it (an op that failed part-way, a message
  // nobody received). A later group under the id would take them, with the same
  // sender, op, code and sequence number, as its own.
  void retire(uint32_t id, bool forGood = false) {
    std::lock_guard<std::mutex> lock(mu_);
    if (forGood) {
      kept_.push_back(id);
      return;
    }
    retired_.push_back(id);
    if (retired_.size() > kRetired) {
      held_.erase(retired_.front());
      retired_.pop_front();
    }
  }

  std::vector<uint32_t> keptForGood() {
    std::lock_guard<std::mutex> lock(mu_);
    return kept_;
  }

 private:
  std::mutex mu_;
  std::set<uint32_t> held_;  // live groups' ids, reserved candidates and retired ids
  std::deque<uint32_t> retired_;
  std::vector<uint32_t> kept_;  // retired for good
};

std::string errorText(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// Makes later work on `device` wait for everything queued so far on the calling
// thread's current stream (host-blocking).
void syncCurrentStream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Event ev(device.type());
  ev.record(impl.getStream(device));
  ev.synchronize();
}

std::optional<c10::Device> firstDeviceTensor(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.defined() && !t.is_cpu()) return t.device();
  }
  return std::nullopt;
}

// What an op of a broken group fails with.
std::string refusal(const std::string& reason) {
  return "the group is unusable after an earlier failure (" + reason +
         "); destroy it and create a new one";
}

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

} // namespace

std::vector<uint32_t> groupIdsHeldForGood() {
  return GroupIds::get().keptForGood();
}

ProcessGroupTDX::ProcessGroupTDX(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                 int size, c10::intrusive_ptr<c10d::Backend::Options> options,
                                 std::vector<int64_t> globalRanks)
    : Backend(rank, size),
      store_(store),
      options_(std::move(options)),
      timeoutMs_(options_->timeout.count()),
      globalRanks_(std::move(globalRanks)),
      flight_(std::make_shared<FlightRecorder>(
          static_cast<size_t>(std::max<int64_t>(1, env::getInt("TDX_FLIGHT_OPS"))))) {
  groupName_ = options_->group_name.empty() ? std::string("default") : options_->group_name;
  checkTimeout(prefix(), options_->timeout);
  // Read only when a window opens, where a bad value would quietly cost the group its
  // windows: checked now, as the other knobs are.
  if (env::get("TDX_SHM_SPIN_US") != "auto") (void)env::getInt("TDX_SHM_SPIN_US");
  const int shmThreads = shmThreadsSetting(prefix());
  const int64_t rootCheck = env::getInt("TDX_ROOT_CHECK");
  TORCH_CHECK_VALUE(rootCheck == 0 || rootCheck == 1, prefix(),
                    ": TDX_ROOT_CHECK must be 0 or 1, not ", rootCheck);
  acknowledgeRooted_ = rootCheck == 1;
  TORCH_CHECK_VALUE(static_cast<uint64_t>(size) < tag::kMaxRanks, prefix(),
                    ": groups are limited to ", tag::kMaxRanks - 1, " ranks");
  setupDeadline_ = Clock::now() + timeout();  // bounded, as every deadline (timeout())
  fault_ = std::make_shared<Fault>();
  fault_->abortFlag = abortFlag_;
  // torch creates the default group with no global ranks.
  const bool defaultGroup = globalRanks_.empty();
  if (globalRanks_.empty()) {
    for (int r = 0; r < size; ++r) globalRanks_.push_back(r);
  }
  TORCH_CHECK_VALUE(static_cast<int>(globalRanks_.size()) == size, prefix(), ": ",
                    globalRanks_.size(), " global ranks given for a group of ", size);
  bool globalNumbers = true;
  for (int r = 0; globalNumbers && r < size; ++r) globalNumbers = globalRanks_[r] == r;
  if (!globalNumbers) {
    rankNote_ = std::make_shared<const std::string>(
        " [ranks named here are this group's; its ranks 0.." + std::to_string(size - 1) +
        " are global ranks " + memberList(globalRanks_) + "]");
  }
  runningOp_->rankNote = rankNote_;

  // One round of store reads settles four things. Each rank publishes whether it allows
  // windows (TDX_SHM), which of its group-id candidates it has free (16 hex digits), its
  // tuning (kTuning) and its host key:
  // - the group id: the first candidate free on every rank (GroupIds);
  // - same host? It decides whether shared-memory algorithms may run and, when the
  //   default group starts the process's transport, whether UCX needs TCP at all: every
  //   other group is a subset of the default one;
  // - windows run only if every rank allows them: ranks that disagreed would choose
  //   different algorithms for the same op and wait on each other forever;
  // - the tuning variables must agree: ranks that cut messages into segments of
  //   different sizes post receives that do not match their peers' sends, and ranks that
  //   price the window's chunks (or its all_reduce's threads) differently may choose
  //   different algorithms. Both would fail mid-op with an error that says nothing of the
  //   cause.
  struct Knob {
    const char* name;
    uint64_t value;
    const char* unit;  // "" for a count; 0 stands for "auto" where the knob takes it
    bool windowsOnly;  // matters only to a group on one host with its windows
  };
  const Knob kTuning[] = {
      {"TDX_SEGMENT_BYTES", algorithms::defaultSegmentBytes(), " bytes", false},
      {"TDX_SHM_SLOT_BYTES", transport::HostWindow::defaultSlotBytes(), " bytes", false},
      {"TDX_SHM_THREADS", static_cast<uint64_t>(shmThreads), "", true},
  };
  const auto knobText = [](const Knob& k, uint64_t v) {
    return *k.unit == '\0' && v == 0 ? std::string("auto") : std::to_string(v) + k.unit;
  };
  std::string tuningText;
  for (const auto& k : kTuning) {
    char digits[17];
    std::snprintf(digits, sizeof(digits), "%016llx", static_cast<unsigned long long>(k.value));
    tuningText += digits;
  }
  const auto idCandidates = GroupIds::candidates(groupName_);
  const uint64_t idsFree = GroupIds::get().reserve(idCandidates);
  constexpr size_t kMaskDigits = 16;
  char maskText[kMaskDigits + 1];
  std::snprintf(maskText, sizeof(maskText), "%016llx", static_cast<unsigned long long>(idsFree));
  // Which members this rank created the group with (a hash of their global ranks) and
  // which of them it is. torch names a group by the order of creation, not by its
  // members: ranks that passed new_group different lists would share a name, a store
  // prefix and group ranks, and exchange each other's data as one group's.
  constexpr size_t kMembersDigits = 24;
  uint64_t membersHash = 1469598103934665603ull;  // FNV-1a
  for (const int64_t g : globalRanks_) {
    for (int b = 0; b < 8; ++b) {
      membersHash = (membersHash ^ ((static_cast<uint64_t>(g) >> (8 * b)) & 0xff)) *
                    1099511628211ull;
    }
  }
  char membersText[kMembersDigits + 1];
  std::snprintf(membersText, sizeof(membersText), "%016llx%08llx",
                static_cast<unsigned long long>(membersHash),
                static_cast<unsigned long long>(globalRanks_[rank]));
  // Rank r's record of the members it named (the hash of the list, its global rank): it
  // must name the same list, and be the global rank this rank's list says. Either rank r
  // named other members, or a rank of another group made under the same name wrote r's
  // record (it is its rank r too). Every such rank fails, or ranks whose lists agree form
  // their group alone: none takes another's data.
  const auto checkMembers = [&](int r, const std::string& theirs) {
    const bool whole = theirs.size() == kMembersDigits;
    const auto writer =
        whole ? static_cast<int64_t>(std::strtoull(theirs.substr(16).c_str(), nullptr, 16))
              : int64_t{-1};
    if (whole && theirs.compare(0, 16, membersText, 16) == 0 && writer == globalRanks_[r]) {
      return;
    }
    const std::string who = "rank " + std::to_string(r) + " of this group (global rank " +
                            std::to_string(globalRanks_[r]) + ")";
    C10_THROW_ERROR(
        DistBackendError,
        prefix() + " " +
            (!whole ? who + " published no readable group record"
             : writer == globalRanks_[r]
                 ? who + " created it with other members than this rank did"
                 : who + " is global rank " + std::to_string(writer) +
                       " in the group of the same name it created") +
            " (this rank's: global ranks " + memberList(globalRanks_) +
            "): every rank of a group must pass new_group the same ranks, and create "
            "its groups in the same order as the others");
  };
  const std::string key = transport::hostKey();
  uint64_t idsFreeEverywhere = idsFree;
  int localRanks = 0;
  bool windowsEverywhere = true;
  std::vector<std::string> cpuTexts;
  std::string windowsDisagreement;  // a windowsOnly knob's
  try {
    // First a generation for this group's keys (StoreGeneration.hpp): the store may be an
    // earlier attempt's (torchrun --max-restarts keeps its store), or have seen a group of
    // this name before, and their keys must never be read as this group's. Every key
    // from here on is under it, and so are the keys of the group's life (timeout notes).
    GenerationHooks hooks;
    hooks.prefix = prefix();
    hooks.identity = membersText;
    hooks.late = [&](const std::vector<int>& late, const std::string& waitedOn,
                     const char* step) {
      if (rank != 0) {
        // Waiting on rank 0 alone, a rank watches every member: one already lost
        // (another group saw it die) means this group cannot form.
        std::vector<int> lost;
        for (int q = 0; q < size; ++q) {
          if (q != rank && knownPeers().lost(globalRanks_[q])) lost.push_back(q);
        }
        setupLate(lost, waitedOn, "join the group");
      }
      setupLate(late, waitedOn, step);
    };
    hooks.due = [&] { return Clock::now() >= setupDeadline_; };
    hooks.differs = checkMembers;
    incarnation_ = static_cast<int64_t>(agreeOnGeneration(*store_, rank, size, hooks));
    store_ = c10::make_intrusive<c10d::PrefixStore>(
        generationPrefix(static_cast<uint64_t>(incarnation_)), store_);
    store_->set("tdx/host/" + std::to_string(rank),
                bytesOf((env::getInt("TDX_SHM") != 0 ? "1" : "0") + std::string(maskText) +
                        membersText + "|" + tuningText + "@" + cpuText() + "|" + key));
    std::string disagreement;
    setupWait("tdx/host/", "join the group");
    for (int r = 0; r < size; ++r) {
      const auto theirs = store_->get("tdx/host/" + std::to_string(r));
      const std::string text(theirs.begin(), theirs.end());
      // flag, mask, members, "|", tuning, "@", CPUs, "|", host key: the separators tell
      // a record of another version apart (which, in turn, refuses this one at the "@";
      // records with the CPUs' earlier format had a "#" there), whose key
      // would otherwise be read as tuning or CPUs.
      const size_t membersAt = 1 + kMaskDigits;
      const size_t tuningAt = membersAt + kMembersDigits + 1;
      const size_t cpusAt = tuningAt + tuningText.size() + 1;
      const size_t cpusEnd = text.size() < cpusAt ? std::string::npos : text.find('|', cpusAt);
      const size_t keyAt = cpusEnd == std::string::npos ? text.size() + 1 : cpusEnd + 1;
      if (text.size() < keyAt || text[tuningAt - 1] != '|' || text[cpusAt - 1] != '@' ||
          text.find(',', cpusAt) >= cpusEnd) {
        C10_THROW_ERROR(DistBackendError,
                        prefix() + " rank " + std::to_string(r) +
                            " published no group record under tdx/host/: every rank of a tdx "
                            "group must run the same torchdist_ext version");
      }
      checkMembers(r, text.substr(membersAt, kMembersDigits));
      idsFreeEverywhere &= std::strtoull(text.substr(1, kMaskDigits).c_str(), nullptr, 16);
      for (size_t k = 0; k < sizeof(kTuning) / sizeof(kTuning[0]); ++k) {
        const uint64_t v = std::strtoull(text.substr(tuningAt + 16 * k, 16).c_str(), nullptr, 16);
        std::string& told = kTuning[k].windowsOnly ? windowsDisagreement : disagreement;
        if (v != kTuning[k].value && told.empty()) {
          told = std::string(kTuning[k].name) + " is " + knobText(kTuning[k], v) + " on rank " +
                 std::to_string(r) + " but " + knobText(kTuning[k], kTuning[k].value) +
                 " on this rank" + (*kTuning[k].unit != '\0' ? " (after rounding)" : "");
        }
      }
      if (text.compare(keyAt, std::string::npos, key) == 0) {
        ++localRanks;
        cpuTexts.push_back(text.substr(cpusAt, cpusEnd - cpusAt));
      }
      windowsEverywhere = windowsEverywhere && text[0] == '1';
    }
    if (disagreement.empty() && localRanks == size && windowsEverywhere) {
      disagreement = windowsDisagreement;
    }
    if (!disagreement.empty()) {
      C10_THROW_ERROR(DistBackendError,
                      prefix() + " " + disagreement +
                          ": set it to the same value on every rank, or leave it unset "
                          "everywhere");
    }
  } catch (...) {
    GroupIds::get().settle(idCandidates, idsFree, -1);
    throw;
  }
  const int chosenId = idsFreeEverywhere == 0 ? -1 : __builtin_ctzll(idsFreeEverywhere);
  GroupIds::get().settle(idCandidates, idsFree, chosenId);
  if (chosenId < 0) {
    C10_THROW_ERROR(DistBackendError,
                    prefix() + " found no group id free on every rank (" +
                        std::to_string(GroupIds::kCandidates) +
                        " tried): too many groups are alive in these processes; destroy "
                        "the ones no longer used (torch.distributed.destroy_process_group)");
  }
  groupId_ = idCandidates[chosenId];
  // Retired with the group at shutdown, or here if the rest of the set-up fails.
  struct RetireOnThrow {
    uint32_t id;
    bool armed = true;
    ~RetireOnThrow() {
      if (armed) GroupIds::get().retire(id);
    }
  } retireOnThrow{groupId_};
  const bool oneHost = localRanks == size;
  placement_.oneHost = oneHost;
  // From the published CPUs of this host's ranks, so all ranks agree (each rank's own
  // mask may differ: pinned to a core each, or not at all).
  hostCpus_ = std::max(1, cpusTogether(cpuTexts));
  placement_.crowded = oneHost && size > hostCpus_;
  // A window's half must hold 64 bytes per rank (all_to_all's split sizes, scatter's
  // and gather's per-rank lines): with the smallest slots, beyond 64 ranks it does not.
  const bool halfFits = transport::HostWindow::defaultSlotBytes() / 2 >= size_t{64} * size;
  placement_.windows = oneHost && windowsEverywhere && halfFits;
  // Threads for the window all_reduce's passes: TDX_SHM_THREADS, or for auto the CPUs
  // the ranks may keep busy together (not hostCpus_, which counts one thread per rank)
  // shared out among them, at most kAutoPassThreads; the window takes it. A subgroup's
  // ranks share the host with the rest of the job: no more CPUs each than the default
  // group's ranks of this host have each, or the job's subgroups working at once would
  // run more threads than there are CPUs.
  int threadCpus = std::max(1, cpusShared(cpuTexts));
  if (defaultGroup) {
    jobCpusPerRank().store(std::max(1, threadCpus / std::max(1, localRanks)));
  } else if (const int share = jobCpusPerRank().load(); share > 0) {
    threadCpus = std::min(threadCpus, share * size);
  }
  const int autoThreads = std::clamp(threadCpus / size, 1, kAutoPassThreads);
  placement_.passThreads = !placement_.windows ? 1 : shmThreads > 0 ? shmThreads : autoThreads;

  try {
    transport::UcxTransport::Hints hints;
    hints.tcpWanted = !(defaultGroup && oneHost);
    hints.localRanks = localRanks;
    hints.localCpus = hostCpus_;
    transport_ = transport::UcxTransport::acquire(hints);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, prefix() + " could not start UCX: " + e.what());
  }
  // Worker addresses go through the group's own (prefixed) store; endpoints are shared
  // per peer process across groups by the transport.
  const std::string addr = transport_->address();
  store_->set("tdx/addr/" + std::to_string(rank),
              std::vector<uint8_t>(addr.begin(), addr.end()));
  endpoints_.resize(size);
  setupWait("tdx/addr/", "publish its transport address");
  transport_->setRank(globalRanks_[rank]);  // the transport's log lines name ranks
  for (int r = 0; r < size; ++r) {
    const auto peer = store_->get("tdx/addr/" + std::to_string(r));
    try {
      endpoints_[r] = transport_->connect(std::string(peer.begin(), peer.end()));
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError, prefix() + " could not connect to rank " +
                                            std::to_string(r) + " (global rank " +
                                            std::to_string(globalRanks_[r]) + "): " + e.what());
    }
    transport_->setPeerRank(endpoints_[r], globalRanks_[r]);
    knownPeers().add(transport_, globalRanks_[r], endpoints_[r]);
  }
  sharedEndpoints_ = std::make_shared<const std::vector<int>>(endpoints_);

  // One cost model for the whole group (rank 0's), so every rank makes the same
  // algorithm choices even when their calibrations differ.
  if (rank == 0) {
    store_->set("tdx/costmodel", bytesOf(algorithms::Registry::get().costModel().serialize()));
  }
  setupWait("tdx/costmodel", "publish the group's cost model");
  const auto model = store_->get("tdx/costmodel");
  costModel_ = algorithms::CostModel::parse(std::string(model.begin(), model.end()));
  peer_ = PeerMemory::create(rank, size, prefix(), [this] { return timeout(); });
  checkFingerprints_ =
      logEnabled(LogLevel::Detail) || c10d::debug_level() == c10d::DebugLevel::Detail;
  // Always: a member that finds a mismatch on its own (a point-to-point header under
  // DETAIL, a collective's message of the wrong size in any mode) tells the others here.
  if (size_ > 1) listenForMismatchNotices();
  if (size_ > 1) listenForGoodbyes();
  worker_ = std::thread([this] { runLoop(); });
  retireOnThrow.armed = false;
  init();
  TDX_LOG(Info, prefix()) << "group ready (id " << groupId_ << ", timeout "
                          << options_->timeout.count() << " ms)";
}

ProcessGroupTDX::~ProcessGroupTDX() {
  shutdown();
}

std::string ProcessGroupTDX::prefix() const {
  std::ostringstream os;
  os << "[tdx r" << rank_ << "/" << size_ << " pg=" << groupName_ << "]";
  return os.str();
}

std::chrono::milliseconds ProcessGroupTDX::timeout() const {
  // Every deadline is now + this: bounded so that the sum cannot overflow.
  return std::min(std::chrono::milliseconds(timeoutMs_.load(std::memory_order_relaxed)),
                  kLongestTimeout);
}

void ProcessGroupTDX::setTimeout(std::chrono::milliseconds timeout) {
  checkTimeout(prefix(), timeout);
  // The worker and the transport's threads read the timeout: they read the atomic copy.
  timeoutMs_.store(timeout.count(), std::memory_order_relaxed);
  options_->timeout = timeout;
}

std::string ProcessGroupTDX::describe(const char* op, uint64_t seq,
                                      const std::vector<at::Tensor>& ts) const {
  std::ostringstream os;
  os << prefix() << " " << op;
  if (seq > 0) os << " #" << seq;
  if (!ts.empty() && ts[0].defined()) {
    os << " (" << c10::toString(ts[0].scalar_type()) << ts[0].sizes() << " on "
       << ts[0].device();
    if (ts.size() > 1) os << ", +" << ts.size() - 1 << " more";
    os << ")";
  }
  return os.str();
}

std::exception_ptr ProcessGroupTDX::wrapError(const std::string& what,
                                              const std::string& message,
                                              const std::string& ranks) {
  try {
    C10_THROW_ERROR(DistBackendError, what + " failed: " + message + ranks);
  } catch (...) {
    return std::current_exception();
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::enqueue(
    c10d::OpType type, const std::string& what, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> inputs, std::function<void(GroupChannel&)> body,
    PeerAttempt peerAttempt, bool writesOutputs, OpLimits limits) {
  // Taken first, so an op that fails its checks leaves nothing for the next one.
  const std::string fingerprintExtra = std::move(tFingerprintExtra);
  tFingerprintExtra.clear();
  const uint32_t detailCode = std::exchange(tDetailCode, 0);
  const int detailRoot = std::exchange(tDetailRoot, -1);
  for (size_t i = 0; writesOutputs && i < outputs.size(); ++i) {
    // The message is built only for a tensor that fails: this runs on every op.
    if (!isWritable(outputs[i])) {
      checkWritable(prefix() + " " + what, outputs[i],
                    outputs.size() == 1 ? std::string("output") : "output " + std::to_string(i));
    }
  }
  // Checked before the op takes a sequence number, which would then be this rank's alone.
  const auto collective = limits.collective ? limits.collective : collectiveOf(type);
  TORCH_INTERNAL_ASSERT(collective.has_value(), what, ": no collective for its op type");
  // Sequence numbers must reach the queue in order: ranks match ops by them, and two
  // threads issuing ops on one group could otherwise queue #2 ahead of #1 on one rank.
  std::lock_guard<std::mutex> ordered(enqueueMu_);
  const uint64_t seq = ++seq_;
  const std::chrono::milliseconds limit =
      limits.timeout.count() > 0 ? std::min(limits.timeout, kLongestTimeout) : timeout();
  // Profiler events are named as other backends name theirs ("gloo:all_reduce"); the
  // record function copies the title.
  const std::string title = "tdx:" + what;
  auto work = c10::make_intrusive<WorkTDX>(type, describe(what.c_str(), seq, inputs), seq,
                                           outputs, limit, title.c_str(), inputs);
  work->setRunningOp(runningOp_);
  // Each op ahead of this one (and this one) ends within the group timeout of its start,
  // so a wait without a timeout of its own is still bounded: by that sum, plus a margin.
  const int ahead = queued_.load() + (running_.load() ? 1 : 0);
  const std::chrono::duration<double> span =
      std::chrono::duration<double>(std::max(limit, timeout())) * (ahead + 1) +
      std::chrono::seconds(5);
  if (span < std::chrono::hours(24 * 365 * 10)) {  // else none: the sum would overflow
    work->setBackstop(std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(span));
  }
  Task task;
  task.work = work;
  task.flightId = flight_->record(seq, what, work->description(), "-");  // chosen when it runs
  task.seq = seq;
  const size_t inputCount = inputs.size();
  task.keepAlive = std::move(inputs);
  task.keepAlive.insert(task.keepAlive.end(), outputs.begin(), outputs.end());
  if (peerAttempt && peer_ && firstDeviceTensor(task.keepAlive)) {
    // CUDA tensors: the peer-memory path when every rank can take it, else the host
    // path once the caller's stream has produced the inputs.
    task.deviceBody = [this, peerAttempt, body](GroupChannel& ch, DeviceContext& ctx) {
      if (peerAttempt(*peer_, ch, ctx)) return;
      ctx.syncReady();
      body(ch);
    };
  } else {
    task.body = std::move(body);
  }
  task.pins = algorithms::Registry::get().pins();
  task.timeout = limit;
  task.fingerprinted = limits.fingerprinted;
  task.tellsPeers = limits.tellsPeers;
  task.collective = *collective;
  task.elementBytes = commonElementBytes(task.keepAlive);
  task.detailCode = detailCode;
  task.detailRoot = detailRoot;
  if (checkFingerprints_ && task.fingerprinted) {
    // Pinned algorithms are part of the call: ranks pinned differently cannot meet.
    const std::string pins = algorithms::Registry::get().overrides(task.pins.get());
    const auto split = task.keepAlive.begin() + static_cast<std::ptrdiff_t>(inputCount);
    std::vector<at::Tensor> compared(limits.fingerprintInputs ? task.keepAlive.begin() : split,
                                     limits.fingerprintOutputs ? task.keepAlive.end() : split);
    task.fingerprint = fingerprintOf(type, what, compared, fingerprintExtra) +
                       (pins.empty() ? std::string() : " algorithms=" + pins);
  }
  if (auto dev = firstDeviceTensor(task.keepAlive)) {
    // The op must see what the caller's stream produced: record an event now, wait for
    // it on the worker thread.
    c10::impl::VirtualGuardImpl impl(dev->type());
    auto ev = std::make_shared<c10::Event>(dev->type());
    ev->record(impl.getStream(*dev));
    task.readyEvent = ev;
  }
  TDX_LOG(Detail, prefix()) << "enqueue " << work->description();
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    if (stopping_) {
      C10_THROW_ERROR(DistBackendError,
                      work->description() + ": the process group has been shut down; "
                                            "create a new one");
    }
    queue_.push_back(std::move(task));
    queued_.fetch_add(1, std::memory_order_release);
  }
  queueCv_.notify_one();
  registerWork(work);
  return work;
}

void ProcessGroupTDX::runLoop() {
  for (;;) {
    Task task;
    bool have = false;
    {
      std::unique_lock<std::mutex> lock(queueMu_);
      auto ready = [&] { return stopping_ || !queue_.empty(); };
      if ((peer_ && peer_->hasPending()) || p2pInFlight_->load() > 0) {
        // Device work may be waiting on peers, or point-to-point ops on a member that
        // may be lost: wake up now and then to watch them.
        queueCv_.wait_for(lock, std::chrono::milliseconds(100), ready);
      } else if (!ready()) {
        // Back-to-back ops (a training step's buckets, a benchmark loop) arrive within
        // microseconds: poll briefly, yielding the core, before paying for a sleep and a
        // wake-up.
        lock.unlock();
        static const auto spin = std::chrono::microseconds(env::getInt("TDX_SPIN_US"));
        const auto until = Clock::now() + spin;
        while (queued_.load(std::memory_order_acquire) == 0 && Clock::now() < until) {
          std::this_thread::yield();
        }
        lock.lock();
        workerAsleep_.store(true);
        queueCv_.wait(lock, [&] { return ready() || p2pInFlight_->load() > 0; });
        workerAsleep_.store(false);
      }
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
        running_.store(true);  // before queued_ drops, so shutdown sees one or the other
        queued_.fetch_sub(1, std::memory_order_release);
        have = true;
      } else if (stopping_) {
        return;
      }
    }
    if (peer_) {
      const std::string stalled = peer_->releaseStalled();
      if (!stalled.empty()) {
        markBroken(stalled);
        TDX_LOG(Error, prefix()) << stalled;
        dumpFlightRecord(stalled);
      }
    }
    if (p2pInFlight_->load() > 0) cancelPointToPointIfBroken();
    if (have) runTask(task);  // clears running_ before the op's waiters hear
  }
}

void ProcessGroupTDX::cancelPointToPointIfBroken() {
  const std::string broken = brokenReason();
  if (broken.empty()) return;
  const std::string reason = refusal(broken);
  std::vector<std::weak_ptr<transport::Request>> unended;
  cancelPointToPoint(reason, &unended);
  // Worker thread only: p2pUnended_ needs no lock. A receive that a live sender is still
  // filling finishes within this grace; one whose sender died part way never does.
  static constexpr auto kGrace = std::chrono::milliseconds(500);
  const auto now = std::chrono::steady_clock::now();
  for (auto& weak : unended) p2pUnended_.emplace_back(std::move(weak), now + kGrace);
  std::vector<std::weak_ptr<transport::Request>> due;
  for (size_t i = 0; i < p2pUnended_.size();) {
    if (p2pUnended_[i].second > now) {
      ++i;
      continue;
    }
    due.push_back(std::move(p2pUnended_[i].first));
    p2pUnended_[i] = std::move(p2pUnended_.back());
    p2pUnended_.pop_back();
  }
  abandonRequests(due, reason);  // the cancel's reason stays theirs
}

void ProcessGroupTDX::abandonRequests(const std::vector<std::weak_ptr<transport::Request>>& rs,
                                      const std::string& reason) {
  // A completion run by abandon() may shut the group down (and drop transport_).
  const auto transport = transport_;
  if (!transport) return;
  for (const auto& weak : rs) {
    if (auto r = weak.lock()) {
      if (!r->done()) transport->abandon(*r, reason);
    }
  }
}

void ProcessGroupTDX::cancelPointToPoint(const std::string& reason,
                                         std::vector<std::weak_ptr<transport::Request>>* unended,
                                         bool sends, bool anySourceReceives) {
  std::vector<std::weak_ptr<transport::Request>> requests;
  {
    std::lock_guard<std::mutex> lock(p2pMu_);
    requests.swap(p2pRequests_);
  }
  for (auto& weak : requests) {
    if (auto r = weak.lock()) {
      if (r->done()) continue;
      transport_->cancel(*r, reason);
      // UCX cancels a receive it has not matched yet; one it has, it lets finish.
      const bool collected = r->isSend ? sends : anySourceReceives && r->endpoint < 0;
      if (unended && collected) unended->push_back(weak);
    }
  }
}

bool ProcessGroupTDX::Fault::record(const std::string& why, bool abort) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    first = !happened.load();
    if (text.empty()) text = why;
    happened.store(true);
  }
  if (abort) {
    cutShort.store(true);
    abortFlag->store(true);
  }
  return first;
}

std::string ProcessGroupTDX::Fault::read() {
  std::lock_guard<std::mutex> lock(mu);
  return text;
}

void ProcessGroupTDX::listenForMismatchNotices() {
  auto fault = fault_;
  auto buffer = std::make_shared<std::vector<char>>(1024);
  noticeRecv_ = transport_->irecv(
      -1, tag::pointToPoint(groupId_, 0, tag::kMismatchTag), tag::kAnySourceMask,
      buffer->data(), buffer->size(), transport::MemType::Host,
      [fault, buffer](transport::Request& r) {
        if (!r.ok()) return;  // cancelled at shutdown
        fault->record(std::string(buffer->data(), std::min(r.receivedBytes, buffer->size())),
                      /*abort=*/true);
      });
}

namespace {

std::string leftText(int q, uint64_t last, uint64_t seq, const std::string& reason) {
  std::string text = "rank " + std::to_string(q) +
                     " shut the group down (destroy_process_group, abort or exit) after " +
                     "issuing " + std::to_string(last) + " collective" + (last == 1 ? "" : "s") +
                     " on it, so it never calls op #" + std::to_string(seq);
  if (!reason.empty()) return text + ", having given the group up: " + reason;
  return text + ": every rank must call the same collectives before it destroys the group";
}

} // namespace

uint64_t ProcessGroupTDX::goodbyeToken() const {
  // FNV-1a over the name, then the incarnation mixed in: the same on every rank of this
  // instance, different for a group re-created under the name or another name whose id
  // hashes alike.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : groupName_) h = (h ^ c) * 1099511628211ull;
  return h ^ (static_cast<uint64_t>(incarnation_) * 0x9e3779b97f4a7c15ull);
}

void ProcessGroupTDX::listenForGoodbyes() {
  auto state = std::make_shared<Goodbyes>(size_, goodbyeToken());
  state->receives.resize(size_);
  auto fault = fault_;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    state->receives[q] = transport_->irecv(
        endpoints_[q], tag::pointToPoint(groupId_, q, tag::kShutdownTag), tag::kFullMask,
        &state->message[q * Goodbyes::kBytes], Goodbyes::kBytes, transport::MemType::Host,
        [state, fault, q](transport::Request& r) {
          if (!r.ok()) return;  // cancelled at shutdown
          const char* m = &state->message[q * Goodbyes::kBytes];
          uint64_t words[Goodbyes::kWords] = {};
          if (r.receivedBytes >= sizeof(words)) std::memcpy(words, m, sizeof(words));
          if (r.receivedBytes < sizeof(words) || words[0] != state->token) {
            state->stale[q].store(true);
            return;
          }
          const uint64_t last = words[1];
          state->reason[q].assign(m + sizeof(words), r.receivedBytes - sizeof(words));
          state->listened[q].store(words[2] != 0);
          // Published before `running` is read, as runTask publishes `running` before it
          // reads this: one of the two sees the other (both sequentially consistent).
          state->lastSeq[q].store(last);
          uint64_t first = state->firstLeft.load();
          while (last < first && !state->firstLeft.compare_exchange_weak(first, last)) {
          }
          const uint64_t now = state->running.load();
          if (now > last) fault->record(leftText(q, last, now, state->reason[q]), /*abort=*/true);
        });
  }
  for (auto& r : state->receives) {
    if (r) r->background.store(true);
  }
  goodbyes_ = std::move(state);
}

std::string ProcessGroupTDX::leftBefore(uint64_t seq) const {
  // Every op passes here: one load, and the scan for the member only once one left.
  if (!goodbyes_ || goodbyes_->firstLeft.load() >= seq) return std::string();
  for (int q = 0; q < size_; ++q) {
    const uint64_t last = goodbyes_->lastSeq[q].load();
    if (last != Goodbyes::kStayed && last < seq) {
      return leftText(q, last, seq, goodbyes_->reason[q]);
    }
  }
  return std::string();
}

namespace {

// Sends `text` as a failure notice to every live member of a group but `self`. Free of
// the group object: point-to-point completions, which may outlive it, send them too.
void sendNotice(transport::Transport& transport, const std::vector<int>& endpoints, int self,
                uint32_t group, const std::string& text,
                const std::vector<bool>& departed = {}) {
  // Kept by the sends' completions; a notice receive holds 1024 bytes.
  auto message = std::make_shared<std::string>(text.substr(0, 1000));
  // A failure is often the death of a peer that the shared-memory windows saw before the
  // transport did: a notice to it would be its first message over UCX's shared memory,
  // whose segment died with it (UCX logs "shmat failed").
  transport.noteExitedPeers();
  for (size_t q = 0; q < endpoints.size(); ++q) {
    if (static_cast<int>(q) == self || transport.endpointFailed(endpoints[q])) continue;
    // A member that shut the group down has no notice receive posted any more: the
    // notice would wait unreceived for a later group with the same id.
    if (q < departed.size() && departed[q]) continue;
    transport.isend(endpoints[q], tag::pointToPoint(group, self, tag::kMismatchTag),
                    message->data(), message->size(), transport::MemType::Host,
                    [message](transport::Request&) {});
  }
}

// The notice a rank sends when it gives the group up for `why`.
std::string gaveUp(int self, const std::string& why) {
  return "rank " + std::to_string(self) + " gave up on the group: " + why;
}

} // namespace

void ProcessGroupTDX::tellPeers(const std::string& text) {
  std::vector<bool> departed(size_, false);
  if (goodbyes_) {
    for (int q = 0; q < size_; ++q) {
      departed[q] = goodbyes_->lastSeq[q].load() != Goodbyes::kStayed;
    }
  }
  sendNotice(*transport_, endpoints_, rank_, groupId_, text, departed);
}

std::string ProcessGroupTDX::timeoutNote(uint64_t seq) {
  // A transfer names only the peer it waited for, which may itself be waiting on the rank
  // that never called. Every rank that reached the op times out on it, each at the group
  // timeout after its own start, so those that did are the ones that say so here within
  // a short grace. The store is the one channel left that needs no peer's cooperation.
  constexpr auto kGrace = std::chrono::seconds(1);
  struct Exchange {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::vector<int> reached, silent;
    std::string error;
  };
  auto ex = std::make_shared<Exchange>();
  const std::string base =
      "tdx/timedout/" + std::to_string(incarnation_) + "/" + std::to_string(seq) + "/";
  // On a thread of its own: a store call has no deadline (a server that stops answering,
  // or another thread's call on the same client, can hold it for minutes), and this
  // thread must go on to tell the peers and end the op. One counter polled, not a key
  // per rank, so the store's load does not grow with the square of the group's size.
  std::thread([ex, store = store_, base, rank = rank_, size = size_, kGrace] {
    std::vector<int> reached{rank}, silent;
    std::string error;
    try {
      store->set(base + std::to_string(rank), bytesOf("1"));
      int64_t count = store->add(base + "count", 1);
      const auto until = Clock::now() + kGrace;
      while (count < size && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        count = store->add(base + "count", 0);
      }
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        const bool said = count >= size || store->check({base + std::to_string(r)});
        (said ? reached : silent).push_back(r);
      }
    } catch (const std::exception& e) {  // the store may be gone with the job
      error = errorText(e);
    }
    std::lock_guard<std::mutex> lock(ex->mu);
    ex->reached = std::move(reached);
    ex->silent = std::move(silent);
    ex->error = std::move(error);
    ex->done = true;
    ex->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(ex->mu);
  const auto until = Clock::now() + kGrace + std::chrono::milliseconds(500);
  while (!ex->done && !aborted_.load() && Clock::now() < until) {
    ex->cv.wait_for(lock, std::chrono::milliseconds(50));
  }
  if (!ex->done) {
    return aborted_.load() ? "" : " (the store did not say in time which ranks reached this op)";
  }
  if (!ex->error.empty()) {
    return " (the store could not say which ranks reached this op: " + ex->error + ")";
  }
  std::sort(ex->reached.begin(), ex->reached.end());
  std::string note = ". Reached this op and timed out on it: " + rankList(ex->reached);
  if (!ex->silent.empty()) {
    note += "; not timed out on it within 1 s: " + rankList(ex->silent) +
            " (never called it, is behind in an earlier op, reached it later, finished it "
            "without waiting, or is gone)";
  }
  return note;
}

void ProcessGroupTDX::markBroken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(brokenMu_);
  if (brokenReason_.empty()) brokenReason_ = reason;
  broken_.store(true);
}

std::shared_ptr<transport::UcxTransport> ProcessGroupTDX::liveTransport() {
  std::lock_guard<std::mutex> lock(transportMu_);
  return transport_;
}

std::string ProcessGroupTDX::brokenReason() {
  return brokenReason(*transport_);
}

std::string ProcessGroupTDX::brokenReason(transport::UcxTransport& ucx) {
  // A member whose connection failed (kill -9, a crash) makes every later op of the group
  // impossible, even one whose data would not pass through it (a broadcast leaf, a send
  // to a live rank): refuse it now rather than let ranks disagree on which ops ran.
  if (!broken_.load() && fault_->happened.load()) markBroken(fault_->read());
  const uint64_t failures = ucx.failedEndpoints();
  if (!broken_.load() && failures != failuresSeen_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(brokenMu_);
    failuresSeen_.store(failures, std::memory_order_relaxed);
    const std::string lost = lostRanksNote(ucx, endpoints_, rank_);
    if (!lost.empty() && brokenReason_.empty()) {
      brokenReason_ = "a member's connection failed" + lost;
      broken_.store(true);
    }
  }
  if (!broken_.load()) return std::string();
  std::lock_guard<std::mutex> lock(brokenMu_);
  return brokenReason_;
}

void ProcessGroupTDX::runTask(Task& task) {
  // The op writes its outputs as a backend does, below autograd: this thread has none of
  // the caller's no_grad or inference mode, and a copy back into a leaf that requires
  // grad, or into an inference tensor, would be refused here though the caller's call
  // was right.
  at::AutoDispatchBelowADInplaceOrView belowAutograd;
  const std::string& what = task.work->description();
  std::exception_ptr error;
  uint32_t steps = 0;
  uint32_t checkSteps = 0;  // the fingerprint exchange's, which are not the op's own
  std::string path;
  flight_->start(task.flightId);
  const std::string broken = brokenReason();
  if (!broken.empty()) {
    error = wrapError(what, refusal(broken), *rankNote_);
    flight_->finish(task.flightId, false, 0, "", "refused: group broken");
  } else {
    try {
      DeviceContext ctx;
      ctx.ready = task.readyEvent;
      ctx.deadline = Clock::now() + task.timeout;
      if (!task.deviceBody) ctx.syncReady();
      GroupChannel ch(*transport_, endpoints_, rank_, groupId_, task.seq,
                      Clock::now() + task.timeout, aborted_, scratch_);
      taskPins_ = task.pins.get();
      if (goodbyes_) goodbyes_->running.store(task.seq);
      runningOp_->start(task.seq);
      ch.setRunningOp(runningOp_.get());
      try {
        const std::string left = leftBefore(task.seq);
        if (!left.empty()) throw std::runtime_error(left);
        if (checkFingerprints_ && task.fingerprinted) {
          checkFingerprint(ch, task.fingerprint);
          checkSteps = ch.stepsDone();
        }
        ch.setCollective(task.collective);
        ch.setElementBytes(task.elementBytes);
        ch.setDetailCode(task.detailCode, task.detailRoot);
        if (task.deviceBody) {
          task.deviceBody(ch, ctx);
        } else {
          task.body(ch);
        }
      } catch (...) {
        steps = ch.stepsDone();
        path = ch.algorithm();  // where it failed; "-" in the record when none was chosen
        if (!ch.quiesce()) {
          // A transfer could not be cancelled: its buffers may still be written, so they
          // go back to the allocator only once the transport has let go of it. The
          // channel moves host memory only (a device tensor goes through a host copy,
          // which the channel holds itself).
          std::vector<at::Tensor> host;
          for (const auto& t : task.keepAlive) {
            if (t.defined() && t.is_cpu()) host.push_back(t);
          }
          const size_t bytes = storageBytes(host);
          ch.holdUntilReleased(std::make_shared<const std::vector<at::Tensor>>(std::move(host)),
                               bytes);
        }
        throw;
      }
      steps = ch.stepsDone();
      path = ch.algorithm().empty() ? "host" : ch.algorithm();
      if (ctx.done) {
        // The op's device work is queued on the backend stream: the work completes on
        // the host now and its waiters order themselves after `done`.
        task.work->setDeviceDone(ctx.done, *ctx.stream);
        path = "cuda-peer";
      } else if (auto dev = firstDeviceTensor(task.keepAlive)) {
        syncCurrentStream(*dev);
        path = "staged " + path;
      }
      flight_->finish(task.flightId, true, steps, path, "");
    } catch (const std::exception& e) {
      if (dynamic_cast<const algorithms::PinRefused*>(&e) != nullptr && steps == checkSteps) {
        // Bad input, refused by every rank before any of the op's steps (the fingerprint
        // exchange under DETAIL, which every rank completed, moves no data of the op):
        // this op fails, the group goes on. (A coalesced op refused after earlier entries
        // ran breaks the group below: those entries' outputs are already written.)
        handleFailure(task, what, e.what(), steps, path, /*refused=*/true, error);
      } else {
        std::string why = errorText(e);
        const bool timedOut = dynamic_cast<const TimedOut*>(&e) != nullptr ||
                              dynamic_cast<const transport::WindowTimedOut*>(&e) != nullptr;
        if (timedOut) {
          // Which limit ran out: a slow op (rather than a stuck one) wants a longer one.
          why += " [the op's limit: " + std::to_string(task.timeout.count()) +
                 " ms, the timeout of its group or call]";
        }
        if (dynamic_cast<const TimedOut*>(&e) != nullptr && !fault_->cutShort.load()) {
          why += timeoutNote(task.seq);
        }
        if (fault_->cutShort.load()) {
          why = fault_->read() + " (this op was cut short by it)";
        } else {
          // This rank gives the group up. Peers that finished the op without it (a
          // broadcast root, window ranks that wait for nobody, ranks that reached the op
          // while this one timed out on another) would otherwise run into it only in a
          // later op, at that op's timeout. A notice that cut this op short came from a
          // peer that has told everyone already.
          if (task.tellsPeers) tellPeers(gaveUp(rank_, what + " failed: " + why));
        }
        handleFailure(task, what, why, steps, path, /*refused=*/false, error);
      }
    }
  }
  taskPins_ = nullptr;  // the task's snapshot dies with it
  if (goodbyes_) goodbyes_->running.store(0);
  runningOp_->start(0);
  // Not running from here on: the caller may destroy the group as soon as it hears.
  running_.store(false);
  task.work->finishPart(error);
}

void ProcessGroupTDX::handleFailure(Task& task, const std::string& what,
                                    const std::string& why, uint32_t steps,
                                    const std::string& path, bool refused,
                                    std::exception_ptr& error) {
  if (!refused) markBroken(what + ": " + why);
  error = wrapError(what, why, *rankNote_);
  flight_->finish(task.flightId, false, steps, path, why);
  // `what` starts with this group's prefix, which the log line already carries.
  const std::string pre = prefix() + " ";
  const std::string op = what.rfind(pre, 0) == 0 ? what.substr(pre.size()) : what;
  if (refused) {
    TDX_LOG(Warn, prefix()) << op << " refused: " << why;
    return;
  }
  TDX_LOG(Error, prefix()) << op << " failed: " << why;
  dumpFlightRecord(op + " failed", why, task.flightId);
}

namespace {

// How long an op's choice goes unannounced in the store: stalls shorter than this are
// how a job waits for a slow rank, and cost the store nothing.
constexpr auto kStoreCheckGrace = std::chrono::seconds(1);

algorithms::PinRefused windowPinRefused(algorithms::Collective c, const char* algorithm) {
  return algorithms::PinRefused(std::string(algorithms::collectiveName(c)) + " is pinned to '" +
                                algorithm +
                                "', which needs the group's shared-memory window, and it "
                                "could not be made (the log says why); pin another "
                                "(torchdist_ext.algorithms() lists them) or set it back to "
                                "'auto'");
}

} // namespace

ProcessGroupTDX::Selected ProcessGroupTDX::select(algorithms::Collective c, double bytes,
                                                  GroupChannel& ch, const char* what) {
  auto& reg = algorithms::Registry::get();
  Selected sel;
  sel.wait = transport::WaitContext{ch.deadline(), &ch.abortedFlag(), what};
  // Which part of the op this is: a coalesced op chooses once per entry.
  const uint64_t part = (ch.seq() << 8) | (ch.nextChoice() & 0xff);
  algorithms::Choice choice;
  try {
    choice = reg.choose(c, bytes, size_, placement_, costModel_, taskPins_);
  } catch (const algorithms::PinRefused&) {
    announceRefusal(part);
    throw;
  }
  const auto wayOf = [&reg](const algorithms::Algorithm* a) {
    return static_cast<uint16_t>(a - reg.all().data() + 1);
  };
  // The lambdas below hold `this` and at most the channel: two pointers, which
  // std::function keeps without allocating.
  choice_ = WayChoice{part, wayOf(choice.algorithm), false, Clock::now() + kStoreCheckGrace,
                      ch.root()};
  if (choice.algorithm->link != algorithms::Link::Net) {
    // A rank that never comes to set the window up may run the op on messages. (Only
    // read if this call sets it up.)
    if (windowState_ == 0) {
      windowTriedSeq_ = ch.seq();
      sel.wait.check = [this, &ch](int peer) {
        runningOp_->stalledOn(peer, RunningOp::kWindowSetup);
        checkPeerWayInStore(peer);
        checkMessagesFrom(ch, peer);
      };
    }
    sel.window = hostWindow(sel.wait);
    if (sel.window == nullptr) {
      // Without the window the group runs as one whose windows are off: the rules
      // measured that way apply, and only message algorithms can run.
      const algorithms::Link net = algorithms::Link::Net;
      if (choice.pinned) {
        // Every rank learns alike that the window is missing: refuse the pin as any
        // other that cannot run, rather than run something else under its name.
        throw windowPinRefused(c, choice.algorithm->name);
      }
      choice = reg.cheapest(c, bytes, size_, placement_.withoutWindows(), costModel_, &net);
    } else if (choice.algorithm->needsCrossMemory && !sel.window->crossMemory()) {
      algorithms::Placement noCrossMemory = placement_;
      noCrossMemory.crossMemory = false;
      choice = reg.choose(c, bytes, size_, noCrossMemory, costModel_, taskPins_);
      // The next best may be a message algorithm, which must not be run (or reported)
      // as a window one.
      if (choice.algorithm->link == algorithms::Link::Net) sel.window = nullptr;
    }
  }
  sel.algorithm = choice.algorithm;
  ch.setAlgorithm(choice.algorithm->name);
  // Every rank says how it runs this part of the op, and a stalled wait compares. Ranks
  // that pinned different algorithms (without TDX_DEBUG=DETAIL, which compares the pins
  // first) would otherwise each wait out the timeout for the other: one in the window
  // and one on messages, or on two plans that never pair up.
  choice_.way = wayOf(choice.algorithm);
  pastWays_[pastNext_++ % pastWays_.size()] = PastWay{part, choice_.way};
  if (windowState_ == 1 && window_) {
    window_->announce(part, choice_.way);  // one store to shared memory: every op may say it
    if (sel.window != nullptr) {
      sel.wait.check = [this, &ch](int peer) {
        runningOp_->stalledOn(peer, RunningOp::kWindow);
        checkPeerWay(peer);
        checkMessagesFrom(ch, peer);
      };
    } else {
      sel.wait.check = [this](int peer) { checkPeerWay(peer); };
    }
    ch.setPeerCheck([this](int peer) { checkPeerWay(peer); });
  } else if (storeAnnounces(ch.seq())) {
    // Without a window, through the store, and only once a wait has stalled. Choices
    // come from the same inputs on every rank but the pins and the op's sizes, so ranks
    // whose choices differ pinned differently or called the op differently.
    ch.setPeerCheck([this](int peer) { checkPeerWayInStore(peer); });
  } else {
    // The op whose window set-up just failed: an earlier entry of it (coalesced) may
    // have set the store check, which would compare this fallback with a peer's
    // provisional announcement of the window algorithm.
    ch.setPeerCheck(nullptr);
  }
  TDX_LOG(Info, prefix()) << what << " #" << seq_.load() << " " << static_cast<uint64_t>(bytes)
                          << " B: " << choice.algorithm->name << " (predicted "
                          << choice.predicted * 1e6 << " us"
                          << (choice.pinned ? ", pinned" : "")
                          << (choice.measured ? ", measured rule" : "") << ")";
  return sel;
}

namespace {

const char* wayWords(algorithms::Link link) {
  switch (link) {
    case algorithms::Link::Shm:
      return "in the shared-memory window";
    case algorithms::Link::Cma:
      return "reading peers' memory in place";
    default:
      return "on messages";
  }
}

// The way a rank announces for a part of an op that it refused to run (its pin cannot).
constexpr uint16_t kRefusedWay = 0xffff;

// Why ranks run one op with different algorithms, and the fix.
constexpr const char* kChoseApart =
    "The ranks chose different algorithms: pin the same one on every rank "
    "(torchdist_ext.set_algorithm, TDX_ALGO) or none, and call the op with tensors of the "
    "same sizes and devices; TDX_DEBUG=DETAIL compares shapes and pins before each op";
// The fix for a rank that refused the op its peers run.
constexpr const char* kPinAlike =
    "Pin the same algorithm on every rank (torchdist_ext.set_algorithm, TDX_ALGO) or none; "
    "TDX_DEBUG=DETAIL compares the pins before each op";

// What this rank runs, for the errors below: "all_reduce with 'ring' (on messages)".
std::string wayText(const algorithms::Algorithm& a) {
  return algorithms::collectiveCallName(a.collective) + std::string(" with '") + a.name +
         "' (" + wayWords(a.link) + ")";
}

// Throws when rank `peer` announced `theirs` (0: nothing for this part) where this rank
// runs `mine` (ways: registry indices plus one).
void throwIfOtherWay(int peer, uint16_t theirs, uint16_t mine) {
  if (theirs == 0 || theirs == mine) return;
  const auto& all = algorithms::Registry::get().all();
  if (theirs == kRefusedWay && mine >= 1 && mine <= all.size()) {
    throw std::runtime_error(
        "collective mismatch: rank " + std::to_string(peer) +
        " refused this op (the algorithm it pinned for it cannot run it; its error says "
        "why) where this rank runs " + wayText(all[mine - 1]) + ". " + kPinAlike);
  }
  if (theirs > all.size() || mine > all.size()) {
    throw std::runtime_error("collective mismatch: rank " + std::to_string(peer) +
                             " runs this op with an algorithm this build does not know; "
                             "every rank must run the same torchdist_ext version");
  }
  const algorithms::Algorithm& a = all[mine - 1];
  const algorithms::Algorithm& b = all[theirs - 1];
  throw std::runtime_error(
      "collective mismatch: rank " + std::to_string(peer) + " runs this op as " + wayText(b) +
      " where this rank runs " + wayText(a) + ". " +
      (a.collective == b.collective
           ? std::string(kChoseApart)
           : "Every rank must call the same collectives in the same order"));
}

// Throws when rank `peer` announced `theirs` for the earlier part `part` (an op number,
// see select()), which this rank ran as `mine` (0: it has no record of that part).
void throwIfOtherWayBefore(int peer, uint64_t part, uint16_t theirs, uint16_t mine) {
  const auto& all = algorithms::Registry::get().all();
  if (theirs == 0 || mine == 0 || theirs == mine || mine > all.size()) return;
  const std::string op = "op #" + std::to_string(part >> 8) + " of the group";
  if (theirs == kRefusedWay) {
    throw std::runtime_error("collective mismatch: rank " + std::to_string(peer) +
                             " refused " + op + " (the algorithm it pinned for it cannot run "
                             "it), which this rank ran as " + wayText(all[mine - 1]) + ". " +
                             kPinAlike);
  }
  if (theirs > all.size()) return;  // another build's: the current part's check says so
  throw std::runtime_error(
      "collective mismatch: rank " + std::to_string(peer) + " runs " + op + " as " +
      wayText(all[theirs - 1]) + " where this rank ran it as " + wayText(all[mine - 1]) +
      " and went on to this op (rank " + std::to_string(peer) +
      " may still be waiting in it). " + kChoseApart);
}

// Throws when rank `peer`, which runs this op as `way` as this rank does, named root
// `theirs` where this rank names `mine` (-1: the op has none). On messages a rank that
// alone names another root waits on a send nobody takes, and the rank it waits for may
// wait on one of its own to it: without this, each would wait out the timeout.
void throwIfOtherRoot(int peer, int theirs, int mine, uint16_t way) {
  if (theirs < 0 || mine < 0 || theirs == mine) return;
  const auto& all = algorithms::Registry::get().all();
  const std::string op = way >= 1 && way <= all.size()
                             ? algorithms::collectiveCallName(all[way - 1].collective)
                             : std::string("this op");
  throw std::runtime_error("collective mismatch: rank " + std::to_string(peer) +
                           " runs this op (" + op + ") with root " + std::to_string(theirs) +
                           " where this rank names root " + std::to_string(mine) +
                           ". Every rank must pass the same root");
}

} // namespace

void ProcessGroupTDX::checkMessagesFrom(const GroupChannel& ch, int peer) {
  // Another collective's message for this op's sequence number is a mismatch whatever
  // the ways, and sentThisOp() throws for it at once.
  const bool sent = ch.sentThisOp(peer);
  if (messageSeenPart_ != choice_.part) {
    messageSeen_.assign(size_, 0);  // the same size each time: no allocation after the first
    messageSeenPart_ = choice_.part;
  }
  if (!sent) {
    messageSeen_[peer] = 0;
    return;
  }
  if (messageSeen_[peer] == 0) {
    messageSeen_[peer] = 1;  // the second look, at the next check, decides
    return;
  }
  const auto& all = algorithms::Registry::get().all();
  const algorithms::Algorithm& mine = all[choice_.way - 1];
  throw std::runtime_error(
      "collective mismatch: rank " + std::to_string(peer) + " runs this op (" +
      algorithms::collectiveCallName(mine.collective) +
      ") on messages (its message for it arrived here) where this rank runs " +
      wayText(mine) +
      ". " + kChoseApart);
}

std::string ProcessGroupTDX::wayKeys() const {
  // A key per rank and incarnation of the group: a group made again under the same name
  // (on a store that outlived the first) never reads the first one's.
  return "tdx/way/" + std::to_string(incarnation_) + "/";
}

bool ProcessGroupTDX::storeAnnounces(uint64_t seq) const {
  // The op during which the window could not be made is the exception: its ranks may
  // have announced the window algorithm they were setting it up for (a provisional
  // choice), and run a fallback now, which must not be compared with that.
  return windowState_ == 0 || (windowState_ == -1 && seq != windowTriedSeq_);
}

void ProcessGroupTDX::announceRefusal(uint64_t part) {
  if (windowState_ == 1 && window_) {
    window_->announce(part, kRefusedWay);
  } else if (storeAnnounces(part >> 8)) {
    // Peers read it after their 1 s grace (checkPeerWayInStore). The refusal ends this
    // op here at once, so the store call goes on a thread of its own as theirs do.
    std::thread([read = wayRead_, store = store_,
                 key = wayKeys() + std::to_string(rank_),
                 part] {
      try {
        writeWay(*read, *store, key, part, kRefusedWay, -1);
      } catch (const std::exception&) {
        // Peers then wait out their deadline, as before.
      }
    }).detach();
  }
}

void ProcessGroupTDX::writeWay(WayRead& read, c10d::Store& store, const std::string& key,
                               uint64_t part, uint16_t way, int root) {
  // Writers are threads of their own, which may run in any order: a later part's way
  // must never be overwritten by an earlier one's (an op refused, then the next op's
  // announcement), or a real mismatch of the later op would go unseen.
  std::lock_guard<std::mutex> lock(read.writeMu);
  if (part < read.written) return;
  store.set(key, bytesOf(std::to_string(part) + " " + std::to_string(way) + " " +
                         std::to_string(root)));
  read.written = part;
}

void ProcessGroupTDX::checkPeerWay(int peer) const {
  // The peer's recent announcements: its way for this part, or for an earlier one this
  // rank ran another way and left (as a broadcast root in the window does at once), in
  // which the peer may still wait for this rank, which will never come.
  constexpr uint64_t mask = transport::HostWindow::kAnnouncedOpMask;
  for (int i = 0; i < transport::HostWindow::kAnnouncements; ++i) {
    const auto a = window_->announced(peer, i);
    if (a.op == (choice_.part & mask)) {
      throwIfOtherWay(peer, a.way, choice_.way);
    } else {
      throwIfOtherWayBefore(peer, a.op, a.way, pastWay(a.op, mask));
    }
  }
}

uint16_t ProcessGroupTDX::pastWay(uint64_t part, uint64_t mask) const {
  for (const auto& p : pastWays_) {
    if (p.way != 0 && (p.part & mask) == part) return p.way;
  }
  return 0;
}

void ProcessGroupTDX::checkPeerWayInStore(int peer) {
  // A key per rank and incarnation of the group, overwritten: the store holds one per
  // member whatever the number of ops, and a group made again under the same name (on
  // a store that outlived the first) never reads the first one's. Only the rank waited
  // for is read, once a second after a grace, so ranks stalled on one late rank cost
  // the store little. (Stalls are how a job waits for a slow rank: most end within it.)
  const auto now = Clock::now();
  if (now < choice_.storeCheckAt) return;
  choice_.storeCheckAt = now + std::chrono::seconds(1);
  {
    // What the latest read found: the peer's way for this part, or for an earlier one
    // that this rank ran another way and left (the peer may still wait in it). A read
    // still in flight: nothing to start.
    std::unique_lock<std::mutex> lock(wayRead_->mu);
    if (wayRead_->way != 0) {
      const int about = wayRead_->peer;
      const uint64_t theirPart = wayRead_->part;
      const uint16_t theirs = wayRead_->way;
      const int theirRoot = wayRead_->root;
      lock.unlock();
      if (theirPart == choice_.part) {
        throwIfOtherWay(about, theirs, choice_.way);
        throwIfOtherRoot(about, theirRoot, choice_.root, theirs);
      } else if (storeAnnounces(theirPart >> 8)) {
        // (Not the op that failed to make the window: it ran a fallback after announcing
        // a provisional choice.)
        throwIfOtherWayBefore(about, theirPart, theirs, pastWay(theirPart, ~uint64_t{0}));
      }
      lock.lock();
    }
    if (wayRead_->busy) return;
    wayRead_->busy = true;
  }
  const std::string base = wayKeys();
  const bool announce = !choice_.announced;
  choice_.announced = true;
  // On a thread of its own, as timeoutNote's: a store call has no deadline (a server
  // that stops answering, or another thread's wait on the same client, can hold it),
  // and this thread must go on watching its op. The next check reads what it found.
  std::thread([read = wayRead_, store = store_, base, announce, rank = rank_, peer,
               part = choice_.part, way = choice_.way, root = choice_.root] {
    uint64_t foundPart = 0;
    uint16_t found = 0;
    int foundRoot = -1;
    try {
      if (announce) writeWay(*read, *store, base + std::to_string(rank), part, way, root);
      const std::string key = base + std::to_string(peer);
      if (store->check({key})) {
        const auto v = store->get(key);
        // "<part> <way> <root>", as writeWay() wrote it.
        std::istringstream in(std::string(v.begin(), v.end()));
        uint64_t p = 0;
        unsigned w = 0;
        int r = -1;
        if (in >> p >> w >> r && w <= 0xffff) {
          foundPart = p;
          found = static_cast<uint16_t>(w);
          foundRoot = r;
        }
      }
    } catch (const std::exception&) {
      // A store that fails leaves the wait to end as it would have (its deadline).
    }
    std::lock_guard<std::mutex> lock(read->mu);
    read->busy = false;
    if (found != 0) {
      read->part = foundPart;
      read->peer = peer;
      read->way = found;
      read->root = foundRoot;
    }
  }).detach();
}

algorithms::Choice ProcessGroupTDX::predict(algorithms::Collective c, double bytes) const {
  // What select() would run, without making the window: once it is known that the
  // window could not be made, or that peers' memory cannot be read in place, the
  // choice changes as it does there.
  auto& reg = algorithms::Registry::get();
  // One snapshot: set_algorithm on another thread must not mix two pin sets.
  const auto pins = reg.pins();
  algorithms::Choice choice = reg.choose(c, bytes, size_, placement_, costModel_, pins.get());
  if (choice.algorithm->link == algorithms::Link::Net) return choice;
  const int outcome = windowOutcome_.load();
  if (outcome == -1) {
    if (choice.pinned) throw windowPinRefused(c, choice.algorithm->name);
    const algorithms::Link net = algorithms::Link::Net;
    return reg.cheapest(c, bytes, size_, placement_.withoutWindows(), costModel_, &net);
  }
  if (outcome == 2 && choice.algorithm->needsCrossMemory) {
    algorithms::Placement noCrossMemory = placement_;
    noCrossMemory.crossMemory = false;
    return reg.choose(c, bytes, size_, noCrossMemory, costModel_, pins.get());
  }
  return choice;
}

void ProcessGroupTDX::setupWait(const std::string& key, const char* step) {
  // The store's own timeout (minutes by default) is not the group's: polled, a member
  // that never comes is named at the group timeout, and one that another group of this
  // process already saw die is named at once. One check covers every rank's key, so the
  // set-up costs the store a request per key and a few more, not two per key. A key that
  // names no rank ("tdx/costmodel") is rank 0's.
  const bool perRank = key.back() == '/';
  std::vector<std::string> keys;
  for (int q = 0; q < (perRank ? size_ : 1); ++q) {
    keys.push_back(perRank ? key + std::to_string(q) : key);
  }
  // A few requests a second at most while a member is late.
  pollStore(*store_, keys, std::chrono::milliseconds(256), [&] {
    const bool due = Clock::now() >= setupDeadline_;
    std::vector<int> late;
    for (int q = 0; q < static_cast<int>(keys.size()); ++q) {
      // The store is asked only at the deadline, or for a rank known to be lost.
      if (q != rank_ && (due || knownPeers().lost(globalRanks_[q])) &&
          !store_->check({keys[q]})) {
        late.push_back(q);
      }
    }
    setupLate(late, perRank ? key : key + "@", step);
    return due;  // at the deadline with no rank late: they came just now
  });
}

void ProcessGroupTDX::setupLate(const std::vector<int>& late, const std::string& key,
                                const char* step) const {
  const auto member = [&](int q) {
    std::string text = "rank " + std::to_string(q);
    if (globalRanks_[q] != q) text += " (global rank " + std::to_string(globalRanks_[q]) + ")";
    return text;
  };
  for (const int q : late) {
    if (knownPeers().lost(globalRanks_[q])) {
      C10_THROW_ERROR(DistBackendError,
                      prefix() + " " + member(q) + " is gone: another group of this "
                      "process lost its connection, so it cannot " + step + ". Create "
                      "groups of the ranks that are still alive");
    }
  }
  if (late.empty() || Clock::now() < setupDeadline_) return;
  // `key` ends in '/' for keys per rank (the late rank's number follows), in '@' for
  // one key (shown without it).
  const bool perRank = key.back() == '/';
  std::string text = prefix() + " " + member(late[0]) + " did not " + step + " within " +
                     std::to_string(timeout().count()) + " ms (store key " +
                     (perRank ? key + std::to_string(late[0]) : key.substr(0, key.size() - 1)) +
                     "): every rank of the group must create it, with the same ranks";
  if (perRank) {
    std::vector<int> did;
    for (int q = 0; q < size_; ++q) {
      if (std::find(late.begin(), late.end(), q) == late.end()) did.push_back(q);
    }
    text += "; done so far: " + rankList(did) + "; not: " + rankList(late);
  }
  C10_THROW_ERROR(DistBackendError, text);
}

std::vector<uint8_t> ProcessGroupTDX::storeGetWithin(const std::string& key, int owner,
                                                     const transport::WaitContext& wc) {
  // Polled (pollStore), so a rank that died before publishing `key` (or an abort, or
  // the op's deadline) is reported instead of blocking for the store's own timeout.
  pollStore(*store_, {key}, std::chrono::milliseconds(100), [&] {
    if (wc.aborted && wc.aborted->load()) {
      throw std::runtime_error(
          "the process group was shut down (destroyed or aborted) while setting up shared "
          "memory");
    }
    const std::string lost = lostRanksNote(*transport_, endpoints_, rank_);
    if (!lost.empty()) {
      throw std::runtime_error("a rank of the group was lost while setting up shared memory" +
                               lost);
    }
    if (wc.check) wc.check(owner);
    if (Clock::now() >= wc.deadline && !store_->check({key})) {
      // A timeout of the op: runTask adds which ranks reached it (timeoutNote).
      throw TimedOut("timed out setting up shared memory for " + std::string(wc.what) +
                     ": rank " + std::to_string(owner) + " has not reached this op or " +
                     "is behind (store key " + key + ")");
    }
    return false;
  });
  return store_->get(key);
}

transport::HostWindow* ProcessGroupTDX::hostWindow(const transport::WaitContext& wc) {
  if (windowState_ != 0) return window_.get();
  windowState_ = -1;  // tried once, whatever the outcome
  try {
    return setUpWindow(wc);
  } catch (...) {
    // A peer lost or late while the window was set up: the group fails with the op. The
    // window goes now, its name with it (rank 0), rather than stay half set up (no peer
    // watch, no cross-memory decision) for the life of the group.
    window_.reset();
    windowOutcome_.store(-1);
    throw;
  }
}

transport::HostWindow* ProcessGroupTDX::setUpWindow(const transport::WaitContext& wc) {
  // Collective: every rank gets here in the same op. Rank 0 creates the object and
  // publishes its name; everyone reports whether it attached; rank 0 removes the name
  // once all have, so a crash later leaves nothing behind in /dev/shm.
  const std::string base = "tdx/shm/";
  std::string error;
  if (rank_ == 0) {
    static std::atomic<uint64_t> counter{0};
    const std::string name = "/tdx_" + std::to_string(getpid()) + "_" +
                             std::to_string(groupId_) + "_" + std::to_string(++counter);
    const size_t slot = transport::HostWindow::defaultSlotBytes();
    try {
      window_ = transport::HostWindow::open(name, true, rank_, size_, slot, hostCpus_,
                                            placement_.passThreads);
    } catch (const std::exception& e) {
      error = e.what();
    }
    store_->set(base + "name", bytesOf(window_ ? name + "|" + std::to_string(slot) : ""));
  } else {
    const auto v = storeGetWithin(base + "name", 0, wc);
    const std::string text(v.begin(), v.end());
    const auto bar = text.find('|');
    if (bar == std::string::npos) {
      error = "rank 0 could not create the window";
    } else {
      try {
        window_ = transport::HostWindow::open(text.substr(0, bar), false, rank_, size_,
                                              std::stoull(text.substr(bar + 1)), hostCpus_,
                                              placement_.passThreads);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  if (window_) window_->publishProbe();
  store_->set(base + "ok/" + std::to_string(rank_), bytesOf(window_ ? "1" : "0"));
  bool all = true;
  for (int r = 0; r < size_; ++r) {
    const auto v = storeGetWithin(base + "ok/" + std::to_string(r), r, wc);
    all = all && v.size() == 1 && v[0] == '1';
  }
  if (window_ && rank_ == 0) window_->unlinkName();
  if (window_ && all) window_->watchPeers();
  if (!all) {
    window_.reset();
    windowOutcome_.store(-1);
    TDX_LOG(Warn, prefix()) << "shared-memory window unavailable"
                            << (error.empty() ? std::string(" on another rank") : ": " + error)
                            << "; using message algorithms for this group";
    return nullptr;
  }
  // Can every rank read every other's memory in place? All must agree.
  store_->set(base + "cma/" + std::to_string(rank_),
              bytesOf(window_->probeCrossMemory() ? "1" : "0"));
  bool cma = true;
  for (int r = 0; r < size_; ++r) {
    const auto v = storeGetWithin(base + "cma/" + std::to_string(r), r, wc);
    cma = cma && v.size() == 1 && v[0] == '1';
  }
  window_->setCrossMemory(cma);
  windowState_ = 1;
  windowOutcome_.store(cma ? 1 : 2);
  TDX_LOG(Info, prefix()) << "shared-memory window ready (" << window_->halfBytes() * 2
                          << " bytes per rank; cross-memory reads "
                          << (cma ? "available" : "unavailable") << ")";
  return window_.get();
}

void ProcessGroupTDX::checkFingerprint(GroupChannel& ch, const std::string& mine) {
  // Fixed-size slots: a mismatch of the fingerprints themselves must not turn into a
  // size mismatch of this exchange.
  constexpr size_t kSlot = 384;
  const int n = ch.size();
  // In the channel's scratch, not on the stack: a receive UCX cannot cancel after an
  // error may still land in it, and quiesce() keeps the scratch alive when one might.
  char* all = ch.scratch(kSlot * n);
  std::memset(all, 0, kSlot * n);
  std::memcpy(all + kSlot * ch.rank(), mine.data(), std::min(mine.size(), kSlot - 1));
  std::vector<algorithms::Block> blocks(n);
  for (int r = 0; r < n; ++r) blocks[r] = algorithms::Block{all + kSlot * r, kSlot};
  algorithms::ringAllgather(ch, blocks);
  for (int r = 0; r < n; ++r) {
    const char* slot = all + kSlot * r;
    const std::string theirs(slot, strnlen(slot, kSlot));  // a peer's slot may lack its NUL
    if (theirs != mine.substr(0, kSlot - 1)) {
      throw std::runtime_error("collective mismatch: rank " + std::to_string(ch.rank()) +
                               " called " + mine + " but rank " + std::to_string(r) +
                               " called " + theirs +
                               ". Every rank must call the same collectives with the same "
                               "dtypes, shapes, roots and reduce ops, in the same order");
    }
  }
}

void ProcessGroupTDX::noteFingerprint(int root, const Reduction* red) const {
  tDetailCode = detailCode(red, root);
  tDetailRoot = root;
  if (!checkFingerprints_) return;
  tFingerprintExtra.clear();
  if (root >= 0) tFingerprintExtra += " root=" + std::to_string(root);
  if (red) tFingerprintExtra += " op=" + red->name;
}

std::vector<FlightEntry> ProcessGroupTDX::flightRecord() const {
  return flight_->snapshot();
}

void ProcessGroupTDX::dumpFlightRecord(const std::string& reason, const std::string& shownAbove,
                                       uint64_t failedId) const {
  // The last ops of this group, to the log and (TDX_DUMP_DIR) to a file: what a user
  // compares across ranks to see which one stopped where. Every rank of a failed group
  // logs it, so the log gets the newest few ops, without the group's prefix or the
  // error it has just printed; the file and flight_recorder() have all of them.
  constexpr size_t kLoggedOps = 8;
  const std::string dir = env::get("TDX_DUMP_DIR");
  const std::string file =
      flight_->dump(dir, "tdx_flight_" + groupName_ + "_r" + std::to_string(rank_) + ".txt");
  FlightFormat brief;
  brief.lastRows = kLoggedOps;
  brief.lastId = failedId;
  brief.prefix = prefix() + " ";
  brief.shownAbove = shownAbove;
  std::string where = "also in " + file;
  if (file.empty()) {
    where = dir.empty() ? "set TDX_DUMP_DIR to keep it in a file"
                        : "could not write it under TDX_DUMP_DIR=" + dir;
  }
  TDX_LOG(Error, prefix()) << "flight recorder after " << reason << " (" << where
                           << "; torchdist_ext.flight_recorder() returns it):\n"
                           << flight_->format(brief);
}

void ProcessGroupTDX::registerWork(const c10::intrusive_ptr<WorkTDX>& work) {
  std::lock_guard<std::mutex> lock(coalesceMu_);
  if (coalesced_) coalesced_->attachChild(work);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::pointToPoint(bool isSend, at::Tensor t,
                                                             int peer, int userTag) {
  const char* op = isSend ? "send" : (peer < 0 ? "recv (any source)" : "recv");
  const std::string ctx = prefix() + " " + op;
  checkTensor(ctx, t, "tensor");
  if (!isSend) checkWritable(ctx, t, "tensor");
  if (peer >= 0) checkRank(ctx, peer, size_, isSend ? "destination rank" : "source rank");
  TORCH_CHECK_VALUE(userTag >= 0 && static_cast<uint64_t>(userTag) <= tag::kMaxUserTag, ctx,
                    ": tag ", userTag, " is out of range; use 0..", tag::kMaxUserTag);
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    TORCH_CHECK(!stopping_, ctx, ": the process group has been shut down; create a new one");
  }
  // This thread's own reference: a shutdown on another thread may drop the group's at
  // any point from here on.
  const auto ucx = liveTransport();
  TORCH_CHECK(ucx, ctx, ": the process group has been shut down; create a new one");

  std::ostringstream desc;
  desc << describe(op, 0, {t}) << " " << (isSend ? "to" : "from") << " rank "
       << (peer < 0 ? std::string("any") : std::to_string(peer)) << " tag " << userTag;
  const std::string what = desc.str();
  auto work = c10::make_intrusive<WorkTDX>(
      isSend ? c10d::OpType::SEND : (peer < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV),
      what, seq_.load(), std::vector<at::Tensor>{t}, timeout(),
      ("tdx:" + std::string(op)).c_str(), std::vector<at::Tensor>{t});
  // In the flight record beside the collectives (sequence 0: point-to-point ops have
  // none), so a hang or failure in one leaves evidence of it too.
  const char* opName = isSend ? "send" : (peer < 0 ? "recv_any_source" : "recv");
  const std::string broken = brokenReason(*ucx);
  if (!broken.empty()) {
    registerWork(work);
    flight_->finish(flight_->record(0, opName, what, "p2p"), false, 0, "p2p",
                    "refused: group broken");
    work->finishPart(wrapError(what, refusal(broken), *rankNote_));
    return work;
  }

  const bool staged = !(t.is_cpu() && t.is_contiguous());
  at::Tensor host;
  if (!staged) {
    host = t;
  } else if (isSend) {
    host = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
  } else {
    host = at::empty(t.sizes(), t.options().device(at::kCPU));
  }

  // Under fingerprint checks every message carries its sender's dtype and shape ahead of
  // its bytes, so a receive whose tensor differs only in dtype or shape (same byte
  // count, which the length check cannot see) fails instead of reinterpreting bytes.
  const bool framed = checkFingerprints_;
  const size_t bytes = host.numel() * host.element_size();
  const std::string mine = framed ? p2pFingerprint(t) : std::string();
  at::Tensor wire = host;
  if (framed) {
    wire = at::empty({static_cast<int64_t>(kP2pHeaderBytes + bytes)}, at::kByte);
    if (isSend) {
      char* w = static_cast<char*>(wire.data_ptr());
      std::memset(w, 0, kP2pHeaderBytes);
      std::memcpy(w, mine.data(), mine.size());
      if (bytes > 0) std::memcpy(w + kP2pHeaderBytes, host.data_ptr(), bytes);
    }
  }

  // A CUDA receive is copied in on the device's default stream once it arrives: that
  // copy must come after what the caller's stream still does with the tensor.
  std::shared_ptr<c10::Event> ready;
  if (!isSend && !t.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(t.device().type());
    ready = std::make_shared<c10::Event>(t.device().type());
    ready->record(impl.getStream(t.device()));
  }
  // Running from here: the staging above, which may throw, is done.
  const uint64_t flightId = flight_->record(0, opName, what, "p2p");
  flight_->start(flightId);
  // The completion lives in the transport (with its request) and holds the transport
  // weakly: a strong reference from there would keep the transport alive for good once
  // the request outlived its group.
  std::weak_ptr<transport::Transport> weakTransport = ucx;
  auto onComplete = [work, t, host, wire, framed, mine, staged, isSend, peer, what, ready,
                     weakTransport, endpoints = sharedEndpoints_, self = rank_,
                     group = groupId_, groupPrefix = prefix(), fault = fault_,
                     inFlight = p2pInFlight_, flight = flight_,
                     rankNote = rankNote_,
                     flightId](transport::Request& r) {
    std::string failure;  // why the op failed ("" when it did not)
    bool sizesDiffer = r.truncated;  // this pair of ops disagrees: only this rank knows
    const int source = peer >= 0 ? peer : static_cast<int>(tag::senderOf(r.senderTag));
    // Null only while the transport is being torn down (which fails what is in flight).
    const auto transport = weakTransport.lock();
    if (r.orphaned.load()) {
      // UCX still holds the buffer (a receive a lost peer left part-filled, or an op
      // its group's shutdown could not cancel): it goes back to the allocator only once
      // UCX lets go of the request. Both are host tensors (a device tensor is staged).
      std::vector<at::Tensor> buffers{wire, host};
      const size_t held = storageBytes(buffers);
      r.holdUntilReleased(transport::countedHold(
          std::make_shared<const std::vector<at::Tensor>>(std::move(buffers)), held));
    }
    if (!r.ok()) {
      // The transport's words (UCX's "Input/output error", say) mean little alone: when
      // the peer is gone, that is said first.
      const bool peerLost = transport && peer >= 0 && transport->endpointFailed((*endpoints)[peer]);
      failure = (peerLost ? "rank " + std::to_string(peer) + " was lost (" + r.error + ")"
                          : r.error) +
                (transport ? lostRanksNote(*transport, *endpoints, self) : "");
      // A message too long for an any-source receive still carries its sender's tag (a
      // point-to-point tag has its kind bit set; an unknown sender leaves it zero).
      if (!isSend && peer < 0 && r.truncated && (r.senderTag >> tag::kKindShift) != 0) {
        failure += " (the message came from rank " + std::to_string(source) + ")";
      }
      if (!isSend && r.truncated && !framed) {
        failure += "; this rank's receive holds " + std::to_string(t.numel()) + " elements (" +
                   std::to_string(r.postedBytes) + " bytes)";
      }
    } else if (!isSend && framed && r.receivedBytes >= kP2pHeaderBytes &&
               p2pHeaderText(wire) != mine) {
      const std::string theirs = p2pHeaderText(wire);
      failure = "point-to-point mismatch: rank " + std::to_string(source) + " sent " + theirs +
                " but this rank (" + std::to_string(self) + ") receives " + mine +
                ". Sender and receiver need the same dtype and shape";
      // The sender's send completed long ago, and other ranks may be about to wait on
      // either side: every member hears of it and gives the group up.
      auto text = std::make_shared<std::string>(
          "point-to-point mismatch: rank " + std::to_string(source) + " sent " + theirs +
          " to rank " + std::to_string(self) + ", whose " +
          what.substr(groupPrefix.size() + 1) + " expected " + mine +
          ". Sender and receiver need the same dtype and shape; the group is unusable now");
      fault->record(*text, /*abort=*/true);
      if (transport && !fault->closed.load()) sendNotice(*transport, *endpoints, self, group, *text);
    } else if (!isSend && r.receivedBytes != r.postedBytes) {
      sizesDiffer = true;
      failure = "received " +
                sizeMismatch(r.receivedBytes, r.postedBytes, framed ? 0 : t.element_size()) +
                ": sender and receiver tensors differ in size" +
                (framed ? " (or TDX_DEBUG=DETAIL is not set on every rank)" : "");
    } else {
      if (!isSend && peer < 0) work->setSourceRank(source);
      if (!isSend && framed && host.numel() > 0) {
        std::memcpy(host.data_ptr(), static_cast<const char*>(wire.data_ptr()) + kP2pHeaderBytes,
                    host.numel() * host.element_size());
      }
      if (!isSend && staged) {
        try {
          // On the device's default stream, whatever thread runs this: a thread waiting
          // on another op (driving the transport meanwhile) may have a stream of its own
          // current, with unrelated work queued on it.
          c10::OptionalStreamGuard guard;
          if (!t.is_cpu()) {
            const c10::Stream stream =
                c10::impl::VirtualGuardImpl(t.device().type()).getDefaultStream(t.device());
            guard.reset_stream(stream);
            if (ready) ready->block(stream);
          }
          at::AutoDispatchBelowADInplaceOrView belowAutograd;  // as in runTask
          t.copy_(host);
          if (!t.is_cpu()) syncCurrentStream(t.device());
        } catch (const std::exception& e) {
          failure = errorText(e);
        }
      }
    }
    std::exception_ptr error;
    if (!failure.empty()) {
      // Which later message pairs with which receive is in doubt now (a cancelled
      // receive's message may still arrive and fill the next one): the group is broken.
      const bool first = fault->record(what + " failed: " + failure, /*abort=*/false);
      if (first && sizesDiffer && transport && !fault->closed.load()) {
        // The sender's send completed as far as it can tell, and it would meet the
        // broken group only at its next op's timeout: every member hears of it now.
        sendNotice(*transport, *endpoints, self, group,
                   gaveUp(self, what + " failed: " + failure));
      }
      error = wrapError(what, failure, *rankNote);
    }
    flight->finish(flightId, failure.empty(), failure.empty() ? 1 : 0, "p2p", failure);
    inFlight->fetch_sub(1);
    work->finishPart(error);
  };

  const size_t wireBytes = wire.numel() * wire.element_size();
  p2pInFlight_->fetch_add(1);
  if (workerAsleep_.load()) {
    // The worker sleeps without a deadline and must start watching. Taking the queue's
    // lock orders this after its check of the count, so the notify reaches it. A worker
    // already waking every 100 ms (ops in flight a moment ago) is left alone: a
    // ping-pong would otherwise wake it once per message.
    { std::lock_guard<std::mutex> lock(queueMu_); }
    queueCv_.notify_one();
  }
  transport::RequestPtr req;
  try {
    if (isSend) {
      req = ucx->isend(endpoints_[peer], tag::pointToPoint(groupId_, rank_, userTag),
                              wire.data_ptr(), wireBytes, transport::MemType::Host, onComplete);
    } else {
      uint64_t tagValue = tag::pointToPoint(groupId_, peer < 0 ? 0 : peer, userTag);
      req = ucx->irecv(peer < 0 ? -1 : endpoints_[peer], tagValue,
                       peer < 0 ? tag::kAnySourceMask : tag::kFullMask, wire.data_ptr(),
                       wireBytes, transport::MemType::Host, onComplete);
    }
  } catch (const std::exception& e) {
    p2pInFlight_->fetch_sub(1);  // nothing was posted, so no completion will count it
    flight_->finish(flightId, false, 0, "p2p", e.what());
    throw;
  } catch (...) {
    p2pInFlight_->fetch_sub(1);
    flight_->finish(flightId, false, 0, "p2p", "posting failed");
    throw;
  }
  std::weak_ptr<transport::Request> weak = req;
  bool closed = false;
  {
    std::lock_guard<std::mutex> lock(p2pMu_);
    closed = p2pClosed_;
    if (closed) {
      // Shut down on another thread since the check above; its cancel of the ops in
      // flight has run, or is running, without this one.
    } else if (p2pRequests_.size() >= p2pPruneAt_) {
      p2pRequests_.erase(std::remove_if(p2pRequests_.begin(), p2pRequests_.end(),
                                        [](const std::weak_ptr<transport::Request>& w) {
                                          auto r = w.lock();
                                          return !r || r->done();
                                        }),
                         p2pRequests_.end());
      // Twice what is still live: with many ops in flight the sweep stays amortised O(1).
      p2pPruneAt_ = std::max<size_t>(64, 2 * p2pRequests_.size());
    }
    if (!closed) p2pRequests_.push_back(weak);
  }
  if (closed) ucx->cancel(*req, "the process group was shut down");
  // The transport is held weakly by the work too: one kept past its group must not keep
  // the transport alive.
  work->setOnTimeout([weakTransport, weak, fault = fault_, endpoints = sharedEndpoints_,
                       self = rank_, group = groupId_, what](std::chrono::milliseconds limit) {
    auto t = weakTransport.lock();
    auto r = weak.lock();
    // Finished after all (at the deadline, or another op of a coalesced block timed
    // out): its own completion has said how it ended.
    if (!r || r->done()) return;
    // The group breaks whether or not the cancel takes (UCX cannot cancel a receive it
    // has matched, nor a rendezvous send to a live peer): a message of this op may still
    // arrive, so which later message pairs with which op is in doubt. Peers hear of it
    // now, not at their next op's timeout.
    const std::string reason = "timed out: the peer never posted the matching op within " +
                               std::to_string(limit.count()) +
                               " ms (the limit of this wait, or the group timeout)";
    const std::string why = what + " " + reason;
    const bool first = fault->record(why, /*abort=*/false);
    if (t && first && !fault->closed.load()) {
      sendNotice(*t, *endpoints, self, group, gaveUp(self, why));
    }
    if (!t) return;
    t->cancel(*r, reason);
    // UCX cannot cancel a rendezvous send: it would hold the wait (and a coalesced
    // block's) past its timeout. Ended here, its buffer left to UCX; the group is broken
    // anyway. Not waited for first: a block's sends time out one after another.
    if (r->isSend) t->abandon(*r, reason);
  });
  // The waiting thread drives the transport while it polls: a small message's
  // completion then runs on that thread, with no wake-up of this process's progress
  // thread and then of the waiter (two thread hops, tens of µs each on a busy host).
  work->setProgress([weakTransport] {
    if (auto t = weakTransport.lock()) t->progress();
  });
  registerWork(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::send(std::vector<at::Tensor>& tensors,
                                                     int dstRank, int tag) {
  checkSingle(prefix() + " send", tensors);
  checkRank(prefix() + " send", dstRank, size_, "destination rank");
  return pointToPoint(true, tensors[0], dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::recv(std::vector<at::Tensor>& tensors,
                                                     int srcRank, int tag) {
  checkSingle(prefix() + " recv", tensors);
  // A negative source must not slip through as "any source" (recvAnysource is that).
  checkRank(prefix() + " recv", srcRank, size_, "source rank");
  return pointToPoint(false, tensors[0], srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  checkSingle(prefix() + " recv", tensors);
  return pointToPoint(false, tensors[0], -1, tag);
}

void ProcessGroupTDX::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalesceMu_);
  TORCH_CHECK(!coalesced_, prefix(),
              " startCoalescing: already coalescing; end the previous block first");
  coalesced_ = c10::make_intrusive<WorkTDX>(c10d::OpType::COALESCED,
                                            prefix() + " coalesced ops", seq_.load(),
                                            std::vector<at::Tensor>{}, timeout());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTDX::endCoalescing() {
  c10::intrusive_ptr<WorkTDX> work;
  {
    std::lock_guard<std::mutex> lock(coalesceMu_);
    TORCH_CHECK(coalesced_, prefix(), " endCoalescing: startCoalescing was not called");
    work = std::move(coalesced_);
    coalesced_.reset();
  }
  work->finishPart(nullptr);  // the block is closed: only its ops remain
  return work;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupTDX::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  const int newRank = static_cast<int>(it - ranks.begin());
  std::vector<int64_t> globals;
  for (int r : ranks) {
    checkRank(prefix() + " split", r, size_, "rank");
    globals.push_back(globalRanks_[r]);
  }
  auto newOpts = opts ? opts : c10::make_intrusive<c10d::Backend::Options>("tdx", timeout());
  if (newOpts->group_name.empty()) {
    std::ostringstream name;
    name << groupName_ << ":split";
    for (int r : ranks) name << "_" << r;
    newOpts->group_name = name.str();
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("tdx-split/" + newOpts->group_name, store);
  return c10::make_intrusive<ProcessGroupTDX>(prefixed, newRank, static_cast<int>(ranks.size()),
                                              newOpts, globals);
}

void ProcessGroupTDX::stopWorker(const std::string& reason) {
  std::deque<Task> pending;
  {
    std::lock_guard<std::mutex> lock(queueMu_);
    stopping_ = true;
    pending.swap(queue_);
  }
  queueCv_.notify_all();
  for (auto& t : pending) {
    t.work->finishPart(wrapError(t.work->description(), reason, *rankNote_));
  }
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();  // shut down from a completion callback on the worker itself
    } else {
      worker_.join();
    }
  }
}

void ProcessGroupTDX::shutdown() {
  // Completion callbacks may run Python (comm hooks) on the worker thread; joining it
  // while holding the GIL would deadlock, so let go of the GIL first.
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release noGil;
    shutdownLocked();
  } else {
    shutdownLocked();
  }
}

void ProcessGroupTDX::shutdownLocked() {
  std::lock_guard<std::mutex> lock(shutdownMu_);
  if (shutDown_) return;
  shutDown_ = true;
  // A group that lost a member waits for nobody: a survivor may be stuck on this rank
  // (a point-to-point receive from it, say), and only this rank's exit releases it. Nor
  // does an aborted group, or one with an op queued or running, which is abandoned
  // below: its peers cannot finish that op either.
  const bool lost = !lostRanksNote(*transport_, endpoints_, rank_).empty();
  const bool busy = queued_.load() > 0 || running_.load();
  sayGoodbye(/*awaitPeers=*/!aborted_ && brokenReason().empty() && !lost && !busy);
  // The notice's buffer lives on with its completion, so a cancel is all it needs.
  if (noticeRecv_ && !noticeRecv_->done()) {
    transport_->cancel(*noticeRecv_, "the process group was shut down");
  }
  // Point-to-point ops still posted end with an error, as their buffers live on with
  // their completions. A receive left posted would take a message meant for a later
  // group that reuses this one's id.
  std::vector<std::weak_ptr<transport::Request>> unended;
  {
    std::lock_guard<std::mutex> lock(p2pMu_);
    p2pClosed_ = true;
  }
  cancelPointToPoint("the process group was shut down", &unended,
                     /*sends=*/true, /*anySourceReceives=*/lost || !brokenReason().empty());
  // Ops still queued or running at shutdown are abandoned, not waited for: shutdown must
  // not hang on a peer that is gone.
  aborted_ = true;
  stopWorker("the process group was shut down before the op ran");
  // The worker is gone now (or this is it). Any-source receives that a lost sender left
  // part-filled end here, as no cancel ends them, rather than at the group timeout.
  for (auto& entry : p2pUnended_) unended.push_back(entry.first);
  p2pUnended_.clear();
  // UCX cannot cancel a rendezvous send, and a group's transport outlives it when other
  // groups share it: a send the peer never receives would hold its op's wait() until
  // the op's own timeout. What the cancels have not ended after a short grace ends here,
  // its buffer left to UCX for good (UCX only reads it). A receive from a live peer is
  // left to finish: abandoned, UCX could still write into a tensor its caller was told
  // is free.
  const auto grace = Clock::now() + std::chrono::milliseconds(200);
  for (const auto& weak : unended) {
    if (auto r = weak.lock()) {
      if (!r->done()) transport_->wait(*r, grace);
    }
  }
  abandonRequests(unended, "the process group was shut down");
  // Messages under this group's id may outlive it where the transport does (other
  // groups share it): a peer's message that no op took waits in it, and after a failure
  // an op's messages may still be on their way, or a send of this rank's still pending.
  // Its id then stays held for good, or a later group under the id could take them.
  const bool failed = !brokenReason().empty() || fault_->happened.load();
  uint64_t found = 0;
  const bool unreceived = transport_->probe(tag::groupTag(groupId_), tag::kGroupFieldMask, found);
  std::shared_ptr<transport::UcxTransport> dropped;
  {
    std::lock_guard<std::mutex> lock(transportMu_);
    dropped.swap(transport_);
  }
  // Approximate (another group may let go of it meanwhile): at worst an id is kept that
  // could have been retired.
  const bool outlived = dropped.use_count() > 1;
  dropped.reset();  // outside the lock: the last reference stops the transport
  fault_->closed.store(true);  // before the id is free for another group
  const bool keep = outlived && (failed || unreceived);
  GroupIds::get().retire(groupId_, keep);
  if (keep) {
    TDX_LOG(Info, prefix()) << "id " << groupId_ << " held for the life of the process: "
                            << (unreceived ? "a message sent to this group was never received"
                                           : "an op of this group failed, and its messages "
                                             "may still arrive");
  }
  TDX_LOG(Info, prefix()) << "shut down";
}

void ProcessGroupTDX::sayGoodbye(bool awaitPeers) {
  // A send completes once its bytes are handed to the transport, not once the peer has
  // read them. A rank whose last sends completed so (a broadcast's root, a sender) could
  // otherwise close its connections while a peer is still reading them, and the peer's
  // receives would fail with "connection reset". After every live peer has said goodbye,
  // none still reads from this rank. Bounded, so a peer that never shuts the group down
  // (or hangs) delays this rank by at most 10 s or the group timeout. A broken or
  // aborted group still says goodbye, so its healthy peers are not held up, but waits for
  // nobody's: a broken one listens for them a moment only (kGoodbyeCourtesyWait), one
  // whose abort() was called not at all.
  if (!transport_ || size_ <= 1) return;
  const bool listens = awaitPeers || !abortCalled_.load();  // see kGoodbyeCourtesyWait
  auto deadline =
      Clock::now() + (awaitPeers ? std::min(timeout(), std::chrono::milliseconds(10000))
                                 : kGoodbyeSendWait);
  // The goodbye says how many collectives this rank issued on the group (see Goodbyes);
  // kept alive by the sends' completions.
  std::string why = brokenReason();
  if (why.empty() && fault_->happened.load()) why = fault_->read();
  const uint64_t words[Goodbyes::kWords] = {goodbyeToken(), seq_.load(), listens ? 1u : 0u};
  // The goodbye stays within UCX's eager-short size over shared memory (92 bytes with
  // its default 128-byte FIFO entries). A longer one is copied into a buffer of the
  // receiver's that the sender maps on first use; a broken peer that already stopped its
  // transport (it listens for goodbyes a moment only) has freed that buffer, and UCX then
  // logs a failed shmat. The reason keeps its gist: this group's prefix goes (the
  // receiver names the rank), and the peers had the whole of it in the failure notice.
  if (!why.empty() && why.front() == '[') {
    const auto end = why.find("] ");
    if (end != std::string::npos) why.erase(0, end + 2);
  }
  constexpr size_t kEagerShortBytes = 92;
  constexpr size_t kReasonBytes = 64;
  static_assert(sizeof(words) + kReasonBytes <= kEagerShortBytes &&
                sizeof(words) + kReasonBytes <= Goodbyes::kBytes);
  if (why.size() > kReasonBytes) why = why.substr(0, kReasonBytes - 3) + "...";
  auto message = std::make_shared<std::string>(sizeof(words) + why.size(), '\0');
  std::memcpy(message->data(), words, sizeof(words));
  std::memcpy(message->data() + sizeof(words), why.data(), why.size());
  std::vector<transport::RequestPtr> sends;
  std::vector<transport::RequestPtr> goodbyes;  // the peers', posted at the group's start
  std::vector<transport::RequestPtr> late;      // posted again here (see Goodbyes::stale)
  if (listens && goodbyes_) {
    for (int q = 0; q < size_ && goodbyes_->late.empty(); ++q) {
      if (goodbyes_->stale[q].load()) goodbyes_->late.assign(size_ * Goodbyes::kBytes, 0);
    }
  }
  // A peer this rank still has a point-to-point op posted with is not waited for: the op
  // ends with this shutdown, so the peer's matching op cannot finish either, and that
  // peer may not shut down soon. (Any-source receives name no peer.)
  std::vector<bool> opPosted(size_, false);
  if (listens) {
    std::unordered_map<int, int> rankOf;
    for (int q = 0; q < size_; ++q) rankOf[endpoints_[q]] = q;
    std::lock_guard<std::mutex> lock(p2pMu_);
    for (const auto& weak : p2pRequests_) {
      const auto r = weak.lock();
      if (!r || r->done() || r->endpoint < 0) continue;
      const auto it = rankOf.find(r->endpoint);
      if (it != rankOf.end()) opPosted[it->second] = true;
    }
  }
  // As for a failure notice: a member whose exit the transport has not seen yet would
  // get this goodbye as its first message over shared memory that died with it.
  transport_->noteExitedPeers();
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || endpoints_[q] < 0 || transport_->endpointFailed(endpoints_[q])) continue;
    // A member gone without listening for goodbyes hears none (Goodbyes::listened).
    if (goodbyes_ && goodbyes_->lastSeq[q].load() != Goodbyes::kStayed &&
        !goodbyes_->listened[q].load()) {
      continue;
    }
    if (listens && goodbyes_ && goodbyes_->receives[q] && !opPosted[q]) {
      if (goodbyes_->stale[q].load()) {
        late.push_back(transport_->irecv(
            endpoints_[q], tag::pointToPoint(groupId_, q, tag::kShutdownTag), tag::kFullMask,
            &goodbyes_->late[q * Goodbyes::kBytes], Goodbyes::kBytes,
            transport::MemType::Host, nullptr));
        goodbyes.push_back(late.back());
      } else {
        goodbyes.push_back(goodbyes_->receives[q]);
      }
    }
    sends.push_back(transport_->isend(endpoints_[q],
                                      tag::pointToPoint(groupId_, rank_, tag::kShutdownTag),
                                      message->data(), message->size(),
                                      transport::MemType::Host, [message](transport::Request&) {}));
  }
  // Waited for in slices: an abort() from another thread queues behind this shutdown,
  // and must not sit out a wait for peers' goodbyes. Once it comes, this shutdown waits
  // as an aborted one does: for its own goodbyes' sends only, briefly. (A group that
  // waits for no peer may have been aborted by a peer's report already: only abort()
  // cuts its short listen shorter.)
  const std::atomic<bool>& cutShort = awaitPeers ? aborted_ : abortCalled_;
  bool abortSeen = false;
  auto waitFor = [&](transport::Request& r, bool peersGoodbye) {
    while (!r.done() && Clock::now() < deadline) {
      if (!abortSeen && cutShort.load()) {
        abortSeen = true;
        deadline = std::min(deadline, Clock::now() + kGoodbyeSendWait);
      }
      if (abortSeen && peersGoodbye) return;
      transport_->wait(r, std::min(deadline, Clock::now() + kAbortPoll));
    }
  };
  for (auto& r : sends) waitFor(*r, false);
  if (!awaitPeers) deadline = std::min(deadline, Clock::now() + kGoodbyeCourtesyWait);
  bool all = true;
  for (auto& r : goodbyes) {
    waitFor(*r, true);
    all = r->done() && all;
  }
  std::vector<transport::RequestPtr> pending = std::move(sends);
  // Every peer's goodbye receive, awaited or not: none may stay posted past the group.
  if (goodbyes_) {
    for (auto& r : goodbyes_->receives) {
      if (r) pending.push_back(r);
    }
  }
  pending.insert(pending.end(), late.begin(), late.end());
  if (!all && awaitPeers && !abortSeen) {
    TDX_LOG(Info, prefix()) << "shut down without every peer's goodbye (a peer has not shut "
                               "this group down yet)";
  }
  for (auto& r : pending) {
    if (!r->done()) transport_->cancel(*r, "the process group was shut down");
  }
  // One deadline for all: a goodbye stuck on a hung peer (a send UCX cannot cancel) must
  // not cost a second per peer.
  const auto cancelled = Clock::now() + std::chrono::seconds(1);
  for (auto& r : pending) transport_->wait(*r, cancelled);
}

void ProcessGroupTDX::abort() {
  // Ops in flight stop at their next check (100 ms at most), and shutdown waits for no
  // peer's goodbye.
  abortCalled_ = true;
  aborted_ = true;
  shutdown();
}

} // namespace tdx
