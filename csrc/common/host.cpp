#include "common/host.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
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
  const long configured = sysconf(_SC_NPROCESSORS_CONF);
  return std::vector<bool>(configured > 0 ? configured : 1, true);
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
      const double q = std::atof(quota.c_str());
      const int cpus = std::max(1, static_cast<int>(std::ceil(q / period)));
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

int cpusTogether(const std::vector<std::string>& texts) {
  std::vector<bool> all;
  int quota = 0;
  bool limited = true;  // every process has a quota
  for (const auto& t : texts) {
    const auto comma = t.find(',');
    if (comma == std::string::npos) continue;
    for (size_t i = 0; i < comma; ++i) {
      const char ch = t[i];
      const int digit = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : 0;
      if (all.size() < 4 * (i + 1)) all.resize(4 * (i + 1), false);
      for (int b = 0; b < 4; ++b) {
        if (digit & (1 << b)) all[4 * i + b] = true;
      }
    }
    const int q = std::atoi(t.c_str() + comma + 1);
    if (q > 0) {
      quota = std::max(quota, q);
    } else {
      limited = false;
    }
  }
  const int count = static_cast<int>(std::count(all.begin(), all.end(), true));
  return limited && quota > 0 ? std::min(count, quota) : count;
}

} // namespace tdx
