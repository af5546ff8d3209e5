#include "common/host.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>

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

std::vector<CpuLimit> cpuLimits(const std::string& procCgroup, const std::string& root) {
  std::ifstream cgroups(procCgroup);
  std::string line, path;
  while (std::getline(cgroups, line)) {
    if (line.rfind("0::", 0) == 0) path = line.substr(3);  // the cgroup v2 entry
  }
  std::vector<CpuLimit> limits;
  if (path.empty() || path[0] != '/') return limits;
  // Every ancestor's limit applies too.
  for (;;) {
    const std::string dir = root + (path == "/" ? std::string() : path);
    std::ifstream f(dir + "/cpu.max");
    std::string quota;
    double period = 0;
    if (f >> quota >> period && quota != "max" && period > 0) {
      // Whole CPUs, rounded down: 1.5 CPUs of time do not give two ranks a core each.
      const double q = std::min(std::atof(quota.c_str()) / period, 1e6);
      if (q > 0) {
        struct stat st;
        char id[48];
        if (stat(dir.c_str(), &st) == 0) {
          std::snprintf(id, sizeof(id), "%llx.%llx", static_cast<unsigned long long>(st.st_dev),
                        static_cast<unsigned long long>(st.st_ino));
        } else {  // the path, as a name free of the text's separators
          std::snprintf(id, sizeof(id), "p%zx", std::hash<std::string>{}(dir));
        }
        limits.push_back(CpuLimit{id, std::max(1, static_cast<int>(q))});
      }
    }
    if (path == "/") break;
    const auto slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return limits;
}

int cpuQuota() {
  int best = 0;
  for (const auto& l : cpuLimits()) {
    if (best == 0 || l.cpus < best) best = l.cpus;
  }
  return best;
}

int usableCpus() {
  const auto cpus = allowedCpus();
  const int count = static_cast<int>(std::count(cpus.begin(), cpus.end(), true));
  const int quota = cpuQuota();
  return std::max(1, quota > 0 ? std::min(count, quota) : count);
}

std::string cpuText(const std::vector<bool>& cpus, const std::vector<CpuLimit>& limits) {
  std::string text;
  for (size_t c = 0; c < cpus.size(); c += 4) {
    int digit = 0;
    for (size_t b = 0; b < 4 && c + b < cpus.size(); ++b) digit |= cpus[c + b] ? 1 << b : 0;
    text += "0123456789abcdef"[digit];
  }
  text += ",";
  for (size_t i = 0; i < limits.size(); ++i) {
    text += (i ? ";" : "") + limits[i].cgroup + ":" + std::to_string(limits[i].cpus);
  }
  return text;
}

std::string cpuText() {
  return cpuText(allowedCpus(), cpuLimits());
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

// cpusTogether (each process one thread) and cpusShared (each as many threads as its
// mask has CPUs): what a process may keep busy is its demand, 1 or its mask's size.
int cpusAtOnce(const std::vector<std::string>& texts, bool threaded) {
  std::vector<std::vector<int>> allowed;
  size_t width = 0;
  // The cgroups with a limit, as a forest: a process counts in its innermost one, and
  // each cgroup runs at most its limit of its own and its descendants' demand.
  struct Cgroup {
    int cpus = 0;
    std::string parent;
    int demand = 0;  // of its own processes: 1 each, or their masks' CPUs with threads
    std::vector<std::string> children;
  };
  std::map<std::string, Cgroup> cgroups;
  int unlimited = 0;
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
    const int demand = threaded ? static_cast<int>(cpus.size()) : 1;
    allowed.push_back(std::move(cpus));
    std::vector<CpuLimit> chain;
    for (size_t at = comma + 1; at < t.size();) {
      size_t end = t.find(';', at);
      if (end == std::string::npos) end = t.size();
      const auto colon = t.find(':', at);
      const int n = colon < end ? std::atoi(t.c_str() + colon + 1) : 0;
      if (colon < end && colon > at && n > 0) chain.push_back(CpuLimit{t.substr(at, colon - at), n});
      at = end + 1;
    }
    if (chain.empty()) {
      unlimited += demand;
      continue;
    }
    cgroups[chain[0].cgroup].demand += demand;
    for (size_t i = 0; i < chain.size(); ++i) {
      auto& c = cgroups[chain[i].cgroup];
      c.cpus = chain[i].cpus;
      if (i + 1 < chain.size() && c.parent.empty() && chain[i + 1].cgroup != chain[i].cgroup) {
        c.parent = chain[i + 1].cgroup;
        cgroups[c.parent].children.push_back(chain[i].cgroup);
      }
    }
  }
  // How many processes can each hold a CPU of their own at once: a maximum matching of
  // processes to the CPUs they may run on. Two ranks pinned to one CPU share it however
  // many other CPUs a third rank may use.
  // With threads, the CPUs any of them may use.
  int held = 0;
  if (threaded) {
    std::vector<char> any(width, 0);
    for (const auto& cpus : allowed) {
      for (int c : cpus) any[c] = 1;
    }
    held = static_cast<int>(std::count(any.begin(), any.end(), 1));
  } else {
    std::vector<int> holder(width, -1);
    for (size_t r = 0; r < allowed.size(); ++r) {
      std::vector<char> seen(width, 0);
      held += assign(static_cast<int>(r), allowed, holder, seen) ? 1 : 0;
    }
  }
  if (cgroups.empty()) return held;
  // Bottom-up: a cgroup runs min(its limit, its own demand + what its children run).
  std::set<std::string> reached;
  std::function<int(const std::string&)> runs = [&](const std::string& name) {
    reached.insert(name);
    const auto& c = cgroups[name];
    int inside = c.demand;
    for (const auto& child : c.children) {
      if (!reached.count(child)) inside += runs(child);
    }
    return std::min(c.cpus, inside);
  };
  int together = unlimited;
  for (const auto& [name, c] : cgroups) {
    if (c.parent.empty()) together += runs(name);
  }
  // Texts that name each other as parents (no real hierarchy does) leave cgroups no root
  // reaches: their processes count as unlimited rather than not at all.
  for (const auto& [name, c] : cgroups) {
    if (!reached.count(name)) together += c.demand;
  }
  return std::min(held, together);
}

} // namespace

int cpusTogether(const std::vector<std::string>& texts) {
  return cpusAtOnce(texts, false);
}

int cpusShared(const std::vector<std::string>& texts) {
  return cpusAtOnce(texts, true);
}

} // namespace tdx
