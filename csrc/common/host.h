// Facts about the host this process runs on.
#pragma once

#include <string>
#include <vector>

namespace tdx {

// The most threads one rank splits a memory pass over, itself included: the range of
// TDX_SHM_THREADS, the size of the helper pool, and the clamp of a window's count.
// Python's calibration.MAX_THREADS must match (a test compares them).
constexpr int kMaxPassThreads = 16;

// The CPUs this process may run on: its affinity mask, or every configured CPU when the
// mask cannot be read.
std::vector<bool> allowedCpus();
// One cgroup v2 CPU limit that applies to this process: the cgroup, named by its
// directory's device and inode (the same cgroup reads the same from every namespace, and
// processes in it share its limit), and the whole CPUs its cpu.max grants, rounded down
// (at least 1).
struct CpuLimit {
  std::string cgroup;
  int cpus = 0;
};
// The limits of this process's cgroup and of each ancestor that has one, innermost
// first, read from `procCgroup` (the "0::<path>" line of /proc/<pid>/cgroup) and the
// cgroup v2 hierarchy mounted at `root`. Empty when there are none or nothing can be
// read (cgroup v1, no mount).
std::vector<CpuLimit> cpuLimits(const std::string& procCgroup = "/proc/self/cgroup",
                                const std::string& root = "/sys/fs/cgroup");
// The tightest of cpuLimits(), or 0 when there is none.
int cpuQuota();
// The CPUs this process may use: allowedCpus() counted, capped by cpuQuota(). Ranks of
// one host that outnumber them take turns on the cores, so waiting by polling steals the
// core a peer needs, and every step that waits for a peer waits for it to be scheduled.
int usableCpus();

// This process's allowed CPUs and CPU limits as text without '|' or '@', to publish to
// other processes: "<hex mask>,<cgroup>:<cpus>;<cgroup>:<cpus>..." (limits innermost
// first; none after the comma when there are none).
std::string cpuText(const std::vector<bool>& cpus, const std::vector<CpuLimit>& limits);
std::string cpuText();
// How many of these processes of one host can run at once, from their cpuText()s: the
// most that can each hold a CPU of their own within their masks (ranks pinned to a core
// each have a core each; two pinned to one core share it), and no more than their cgroups
// grant: each cgroup's processes, its child cgroups' included, run at most its limit at
// once, and processes in different cgroups add up. Malformed texts are left out.
int cpusTogether(const std::vector<std::string>& texts);
// How many CPUs these processes may keep busy at once when each runs threads: the CPUs
// of their masks together, and no more than their cgroups grant (a cgroup's processes,
// its child cgroups' included, at most its limit).
int cpusShared(const std::vector<std::string>& texts);

} // namespace tdx
