#include "c10d/FlightRecorder.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace tdx {

FlightRecorder::FlightRecorder(size_t capacity)
    : capacity_(capacity == 0 ? 1 : capacity), epoch_(std::chrono::steady_clock::now()) {}

double FlightRecorder::nowMs() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - epoch_)
      .count();
}

uint64_t FlightRecorder::record(uint64_t seq, std::string op, std::string detail,
                                std::string path) {
  std::lock_guard<std::mutex> lock(mu_);
  FlightEntry e;
  e.id = nextId_++;
  e.seq = seq;
  e.op = std::move(op);
  e.detail = std::move(detail);
  e.path = std::move(path);
  e.state = "queued";
  e.queuedAtMs = nowMs();
  entries_.push_back(std::move(e));
  while (entries_.size() > capacity_) entries_.pop_front();
  return entries_.back().id;
}

FlightEntry* FlightRecorder::find(uint64_t id) {
  // Ids are consecutive, so the entry (if still kept) is at a known offset.
  if (entries_.empty() || id < entries_.front().id) return nullptr;
  const uint64_t off = id - entries_.front().id;
  return off < entries_.size() ? &entries_[off] : nullptr;
}

void FlightRecorder::start(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FlightEntry* e = find(id)) {
    e->state = "running";
    e->startedAtMs = nowMs();
  }
}

void FlightRecorder::finish(uint64_t id, bool ok, uint32_t stepsDone, const std::string& path,
                            const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FlightEntry* e = find(id)) {
    e->state = ok ? "done" : "failed";
    e->stepsDone = stepsDone;
    if (!path.empty()) e->path = path;
    e->error = error;
    const double start = e->startedAtMs >= 0 ? e->startedAtMs : e->queuedAtMs;
    e->durationMs = nowMs() - start;
  }
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {entries_.begin(), entries_.end()};
}

std::string FlightRecorder::format(const FlightFormat& how) const {
  std::ostringstream os;
  const std::vector<FlightEntry> all = snapshot();
  size_t end = all.size();
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].id == how.lastId) end = i + 1;
  }
  const size_t skip = end > how.lastRows ? end - how.lastRows : 0;
  // The op and path columns fit the longest name shown ("all_gather_into_tensor_coalesced",
  // "staged dissemination") and a space; the queue time counts from the recorder's
  // start, not a wait.
  size_t opWidth = 22, pathWidth = 15;
  for (size_t i = skip; i < end; ++i) {
    opWidth = std::max(opWidth, all[i].op.size() + 1);
    pathWidth = std::max(pathWidth, all[i].path.size() + 1);
  }
  const int opW = static_cast<int>(opWidth), pathW = static_cast<int>(pathWidth);
  os << std::left << std::setw(6) << "seq" << std::setw(opW) << "op" << std::setw(pathW)
     << "path" << std::setw(9) << "state" << std::setw(7) << "steps" << std::setw(15)
     << "queued at(ms)" << std::setw(12) << "took(ms)" << "detail / error\n";
  if (skip > 0) os << "(" << skip << " earlier op(s) not shown)\n";
  for (size_t i = skip; i < end; ++i) {
    const FlightEntry& e = all[i];
    const bool prefixed = !how.prefix.empty() && e.detail.rfind(how.prefix, 0) == 0;
    const std::string detail = prefixed ? e.detail.substr(how.prefix.size()) : e.detail;
    std::ostringstream took;
    if (e.durationMs >= 0) took << std::fixed << std::setprecision(3) << e.durationMs;
    else took << "-";
    std::ostringstream queued;
    queued << std::fixed << std::setprecision(1) << e.queuedAtMs;
    os << std::setw(6) << e.seq << std::setw(opW) << e.op << std::setw(pathW) << e.path
       << std::setw(9) << e.state << std::setw(7) << e.stepsDone << std::setw(15)
       << queued.str() << std::setw(12) << took.str() << detail;
    if (!e.error.empty()) {
      os << " | " << (!how.shownAbove.empty() && e.error == how.shownAbove ? "(the error above)"
                                                                          : e.error);
    }
    os << "\n";
  }
  if (end < all.size()) os << "(" << all.size() - end << " later op(s) not shown)\n";
  return os.str();
}

std::string FlightRecorder::dump(const std::string& dir, const std::string& fileName) const {
  if (dir.empty()) return "";
  ::mkdir(dir.c_str(), 0777);  // may exist already
  const std::string path = dir + "/" + fileName;
  std::ofstream out(path);
  if (!out) return "";
  out << format();
  return out ? path : "";
}

} // namespace tdx
