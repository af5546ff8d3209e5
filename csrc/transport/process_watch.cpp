#include "transport/process_watch.h"

#include <sys/epoll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every Linux architecture
#endif

namespace tdx {
namespace transport {

std::string hostKey() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string key = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  std::getline(boot, bootId);
  key += "/" + bootId;
  for (const char* ns : {"/proc/self/ns/mnt", "/proc/self/ns/ipc", "/proc/self/ns/pid"}) {
    struct stat st {};
    key += "/" + std::to_string(stat(ns, &st) == 0 ? static_cast<long long>(st.st_ino) : -1);
  }
  return key;
}

uint64_t processStartTime(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return 0;
  // Field 2 is the command name in parentheses, which may itself hold spaces and ')':
  // the fields after it start past the last ')'. Field 22 is the 20th after it.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return 0;
  }
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return 0;
  }
}

ProcessId ProcessId::self() {
  ProcessId id;
  id.host = hostKey();
  id.pid = getpid();
  id.startTime = processStartTime(id.pid);
  return id;
}

std::string ProcessId::serialize() const {
  return std::to_string(pid) + "\n" + std::to_string(startTime) + "\n" + host;
}

ProcessId ProcessId::parse(const std::string& bytes) {
  const size_t a = bytes.find('\n');
  const size_t b = a == std::string::npos ? a : bytes.find('\n', a + 1);
  if (b == std::string::npos) {
    throw std::invalid_argument("malformed process id (" + std::to_string(bytes.size()) +
                                " bytes)");
  }
  ProcessId id;
  try {
    id.pid = std::stoll(bytes.substr(0, a));
    id.startTime = std::stoull(bytes.substr(a + 1, b - a - 1));
  } catch (const std::exception&) {
    throw std::invalid_argument("malformed process id: pid or start time is not a number");
  }
  id.host = bytes.substr(b + 1);
  return id;
}

bool ProcessWatch::supported() {
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

ProcessWatch::ProcessWatch() : epollFd_(epoll_create1(EPOLL_CLOEXEC)) {}

ProcessWatch::~ProcessWatch() {
  for (auto& kv : pidfds_) ::close(kv.second);
  if (epollFd_ >= 0) ::close(epollFd_);
}

bool ProcessWatch::watch(int id, const ProcessId& who) {
  if (epollFd_ < 0 || who.pid <= 0 || who.startTime == 0) return false;
  if (!who.sameHostAs(ProcessId::self())) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (pidfds_.count(id) != 0) return true;
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(who.pid), 0));
  if (fd < 0) {
    if (errno == ESRCH) {  // already gone
      gone_.push_back(id);
      return true;
    }
    return false;  // ENOSYS (kernel < 5.3), EPERM under a seccomp filter, ...
  }
  // The pidfd was taken before this check, so if the start time still matches now, the
  // pidfd is the peer's and not a later process that was given its pid.
  if (processStartTime(who.pid) != who.startTime) {
    ::close(fd);
    gone_.push_back(id);
    return true;
  }
  epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = EPOLLIN;
  ev.data.u64 = static_cast<uint64_t>(id);
  if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    ::close(fd);
    return false;
  }
  pidfds_[id] = fd;
  return true;
}

std::vector<int> ProcessWatch::exited() {
  std::vector<int> out;
  if (epollFd_ < 0) return out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(gone_);
  epoll_event events[16];
  for (;;) {
    const int n = epoll_wait(epollFd_, events, 16, 0);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) {
      const int id = static_cast<int>(events[i].data.u64);
      auto it = pidfds_.find(id);
      if (it == pidfds_.end()) continue;
      epoll_ctl(epollFd_, EPOLL_CTL_DEL, it->second, nullptr);
      ::close(it->second);
      pidfds_.erase(it);
      out.push_back(id);
    }
    if (n < 16) break;
  }
  return out;
}

} // namespace transport
} // namespace tdx
