// Facts about the host this process runs on.
#pragma once

#include <string>
#include <vector>

namespace tdx {

// The CPUs this process may run on: its affinity mask, or every configured CPU when the
// mask cannot be read.
std::vector<bool> allowedCpus();
// Whole CPUs a cgroup v2 quota (cpu.max of this process's cgroup or an ancestor) grants,
// rounded down (at least 1); 0 when there is none or it cannot be read.
int cpuQuota();
// The CPUs this process may use: allowedCpus() counted, capped by cpuQuota(). Ranks of
// one host that outnumber them take turns on the cores, so waiting by polling steals the
// core a peer needs, and every step that waits for a peer waits for it to be scheduled.
int usableCpus();

// This process's allowed CPUs and quota as text without '|' ("<hex mask>,<quota>"), to
// publish to other processes.
std::string cpuText();
// How many of these processes of one host can run at once, from their cpuText()s: the
// most that can each hold a CPU of their own within their masks (ranks pinned to a core
// each have a core each; two pinned to one core share it), capped by the largest quota
// when every process has one. Malformed texts are left out.
int cpusTogether(const std::vector<std::string>& texts);

} // namespace tdx
