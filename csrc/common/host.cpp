#include "common/host.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>

namespace tdx {

std::vector<bool> allowedCpus() {
  // A fixed cpu_set_t holds 1024 CPUs; the kernel refuses a mask shorter than its own
  // (EINVAL), so larger hosts need a larger one.
  for (int n = 1024; n <= (1 << 16); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<bool> cpus(n, false);
      int last = -1;
      for (int c = 0; c < n; ++c) {
        if (CPU_ISSET_S(c, bytes, set)) {
          cpus[c] = true;
          last = c;
        }
      }
      CPU_FREE(set);
      cpus.resize(last + 1);
      return cpus;
    }
    const int err = errno;
    CPU_FREE(set);
    if (err != EINVAL) break;
  }
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return std::vector<bool>(online > 0 ? online : 1, true);
}

int cpuQuota() {
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(cgroups, line)) {
    if (line.rfind("0::", 0) == 0) path = line.substr(3);  // the cgroup v2 entry
  }
  if (path.empty()) return 0;
  int best = 0;
  // Every ancestor's limit applies too; the tightest wins.
  for (;;) {
    std::ifstream f("/sys/fs/cgroup" + (path == "/" ? std::string() : path) + "/cpu.max");
    std::string quota;
    double period = 0;
    if (f >> quota >> period && quota != "max" && period > 0) {
      // Whole CPUs, rounded down: 1.5 CPUs of time do not give two ranks a core each.
      const double q = std::min(std::atof(quota.c_str()) / period, 1e6);
      const int cpus = std::max(1, static_cast<int>(q));
      if (q > 0 && (best == 0 || cpus < best)) best = cpus;
    }
    if (path == "/" || path.empty()) break;
    const auto slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return best;
}

int usableCpus() {
  const auto cpus = allowedCpus();
  const int count = static_cast<int>(std::count(cpus.begin(), cpus.end(), true));
  const int quota = cpuQuota();
  return std::max(1, quota > 0 ? std::min(count, quota) : count);
}

std::string cpuText() {
  const auto cpus = allowedCpus();
  std::string hex;
  for (size_t c = 0; c < cpus.size(); c += 4) {
    int digit = 0;
    for (size_t b = 0; b < 4 && c + b < cpus.size(); ++b) digit |= cpus[c + b] ? 1 << b : 0;
    hex += "0123456789abcdef"[digit];
  }
  return hex + "," + std::to_string(cpuQuota());
}

namespace {

// Kuhn's augmenting path: gives rank `r` a CPU of its own, moving earlier ranks to other
// CPUs of theirs where needed.
bool assign(int r, const std::vector<std::vector<int>>& allowed, std::vector<int>& holder,
            std::vector<char>& seen) {
  for (int c : allowed[r]) {
    if (seen[c]) continue;
    seen[c] = 1;
    if (holder[c] < 0 || assign(holder[c], allowed, holder, seen)) {
      holder[c] = r;
      return true;
    }
  }
  return false;
}

} // namespace

int cpusTogether(const std::vector<std::string>& texts) {
  std::vector<std::vector<int>> allowed;
  size_t width = 0;
  int quota = 0;
  bool limited = true;  // every process has a quota
  for (const auto& t : texts) {
    const auto comma = t.find(',');
    if (comma == std::string::npos) continue;
    std::vector<int> cpus;
    for (size_t i = 0; i < comma; ++i) {
      const char ch = t[i];
      const int digit = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : 0;
      for (int b = 0; b < 4; ++b) {
        if (digit & (1 << b)) cpus.push_back(static_cast<int>(4 * i) + b);
      }
    }
    width = std::max(width, 4 * comma);
    allowed.push_back(std::move(cpus));
    const int q = std::atoi(t.c_str() + comma + 1);
    if (q > 0) {
      quota = std::max(quota, q);
    } else {
      limited = false;
    }
  }
  // How many processes can each hold a CPU of their own at once: a maximum matching of
  // processes to the CPUs they may run on. Two ranks pinned to one CPU share it however
  // many other CPUs a third rank may use.
  std::vector<int> holder(width, -1);
  int held = 0;
  for (size_t r = 0; r < allowed.size(); ++r) {
    std::vector<char> seen(width, 0);
    held += assign(static_cast<int>(r), allowed, holder, seen) ? 1 : 0;
  }
  return limited && quota > 0 ? std::min(held, quota) : held;
}

} // namespace tdx
