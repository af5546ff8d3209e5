#include "common/env.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace tdx {
namespace env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> kKnobs = {
      {"TDX_DEBUG", "WARN",
       "log level: ERROR, WARN, INFO (init, algorithm choices), DETAIL or DEBUG (every op, "
       "and the cross-rank check of each op's arguments); any other value means WARN"},
      {"TDX_SPIN_US", "50",
       "microseconds a waiting thread polls (UCX, a group's queue, an op's completion) "
       "before sleeping; lower it when ranks outnumber cores"},
      {"TDX_FLIGHT_OPS", "64",
       "how many recent ops of each group the flight recorder keeps, point-to-point ops "
       "included (at least 1)"},
      {"TDX_DUMP_DIR", "",
       "directory where a failed or timed-out op writes its group's flight record "
       "(tdx_flight_<group>_r<rank>.txt); empty: log only"},
      {"TDX_UCX_PEER_ERRORS", "auto",
       "auto: a peer on this host is watched through its pidfd (a kill -9 is an error at "
       "once) and UCX may use shared memory to reach it; peers on other hosts, or where "
       "the kernel has no pidfd_open, get UCX's peer error handling. 1: UCX's peer error "
       "handling for every peer (its shared-memory transports cannot provide it, so "
       "intra-node traffic uses TCP loopback). 0: none (peers on other hosts caught only "
       "by the op's timeout)"},
      {"TDX_UCX_TCP", "auto",
       "whether UCX loads its TCP transport, which listens on a port of every interface it "
       "uses: auto: not when the default group's ranks all run on this host and can watch "
       "each other (TDX_UCX_PEER_ERRORS is not 1, the kernel has pidfd_open), so a "
       "one-host job opens no port; 1: always (needed to reach other hosts); 0: never. A "
       "UCX_TLS of the user's own overrides this"},
      {"TDX_CUDA_PEER", "1",
       "1: CUDA collectives among ranks of one host read and write each other's buffers "
       "through CUDA IPC; 0: stage them through host memory instead"},
      {"TDX_CUDA_PEER_SYNC", "auto",
       "how ranks of the CUDA peer path wait for each other: gpu (flags in device memory, "
       "awaited by the stream; no host sync), host (the backend's thread synchronises), "
       "auto (host when ranks share a GPU, else gpu; decided from the previous op's "
       "exchange, so a group's first peer op uses gpu)"},
      {"TDX_ALGO", "",
       "pin algorithms per collective, e.g. allreduce:ring,broadcast:tree (names: "
       "torchdist_ext.algorithms()); unset: the cost model picks"},
      {"TDX_ROOT_CHECK", "1",
       "1: broadcast, reduce, gather and scatter on messages send their first message to "
       "each peer with acknowledgement (the send ends once the peer has taken it), so "
       "ranks that disagree on the root fail, at the latest at the group timeout, instead "
       "of returning their own data and leaving messages for a later op to take; 0: plain "
       "sends, which spare a sender (a broadcast's or scatter's root and a broadcast's "
       "inner ranks, the other ranks of a reduce or gather) a round trip, without that "
       "check; each rank's own setting governs its sends"},
      {"TDX_SEGMENT_BYTES", "1048576",
       "(at least 4096) transfers that the receiver reduces as they land (RecvReduce) are "
       "cut into segments of this size, all in flight at once, so reducing one overlaps "
       "receiving the next; other transfers move as one message; the same on every rank "
       "(checked when a group is created)"},
      {"TDX_SHM", "1",
       "1: ranks of one host may use shared-memory windows (POSIX shm) for collectives; "
       "0: messages only"},
      {"TDX_SHM_SLOT_BYTES", "2097152",
       "bytes of a rank's shared-memory slot (two halves used alternately; at least 8192, "
       "at most 2^48, "
       "rounded up to 8 KiB; a half holding less than 64 bytes per rank means no windows); "
       "larger slots "
       "mean fewer signals per op, smaller ones stay in cache; the same on every rank "
       "(checked when a group is created)"},
      {"TDX_CROWDED_STEP_US", "200",
       "microseconds the cost model adds to each step of a message algorithm when a "
       "group's ranks, all on one host, outnumber the CPUs they may run on together (a "
       "step then waits for a peer to be scheduled); rank 0's value counts; 0 prices such "
       "groups as uncrowded; negative is an error"},
      {"TDX_SHM_THREADS", "auto",
       "threads each rank splits a shared-memory all_reduce's copies and reductions over "
       "(1 to 16; passes under 64 KiB per thread stay on one); auto: the CPUs the "
       "window's ranks may keep busy together, shared out among them, at most 8 (1 when "
       "ranks have no spare cores; a subgroup's ranks no more than the default group's "
       "have each); the same on every rank of a group with windows (checked when it is "
       "created)"},
      {"TDX_SHM_SPIN_US", "auto",
       "microseconds a rank polls a shared-memory window (yielding the core) before it "
       "sleeps on a futex; auto: 100 while the window's ranks fit the CPUs they may run on "
       "together, else 0"},
  };
  return kKnobs;
}

static const Knob& find(const char* name) {
  for (const auto& k : knobs()) {
    if (std::strcmp(k.name, name) == 0) {
      return k;
    }
  }
  throw std::logic_error(std::string("unregistered TDX knob ") + name);
}

std::string get(const char* name) {
  const Knob& k = find(name);
  const char* v = std::getenv(k.name);
  return (v != nullptr && *v != '\0') ? std::string(v) : std::string(k.defaultValue);
}

int64_t getInt(const char* name) {
  const std::string v = get(name);
  // The whole value, not a leading number: "64K" or "50us" read as 64 or 50 would run
  // with a setting nobody asked for.
  size_t used = 0;
  int64_t n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  while (used > 0 && used < v.size() && std::isspace(static_cast<unsigned char>(v[used]))) {
    ++used;
  }
  if (used == 0 || used != v.size()) {
    throw std::invalid_argument(std::string(name) + "=" + v +
                                " is not an integer; unset it or give a whole number "
                                "(no units or suffixes)");
  }
  return n;
}

std::string describe() {
  std::ostringstream os;
  bool first = true;
  for (const auto& k : knobs()) {
    const char* v = std::getenv(k.name);
    os << (first ? "" : ", ") << k.name << "=" << get(k.name)
       << ((v == nullptr || *v == '\0') ? " (default)" : "");
    first = false;
  }
  return os.str();
}

} // namespace env
} // namespace tdx
