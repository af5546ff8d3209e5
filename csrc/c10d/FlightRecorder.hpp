// The flight recorder: the last N ops of one group, with the state and the step each
// reached, so that a timeout or a failure leaves evidence of where every rank was.
//
// Entries are written at enqueue (queued), when the op starts (running) and when it
// ends (done or failed). On a failure the group logs the table and, when TDX_DUMP_DIR is
// set, writes it to <dir>/tdx_flight_<group>_r<rank>.txt. Python reads it through
// torchdist_ext.flight_recorder(group).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace tdx {

struct FlightEntry {
  uint64_t id = 0;         // position in the recorder (monotonic)
  uint64_t seq = 0;        // the op's sequence number in its group (0 for p2p)
  std::string op;          // "all_reduce", "send", ...
  std::string detail;      // dtype, shape, device, peer
  std::string path;        // how it ran: "host", "cuda-peer", "p2p"
  std::string state;       // queued, running, done, failed
  uint32_t stepsDone = 0;  // transfers completed (collectives)
  std::string error;
  double queuedAtMs = 0;   // since the recorder was created
  double startedAtMs = -1;
  double durationMs = -1;  // from start to end; -1 while unfinished
};

// What format() leaves out, for the table logged beside an error: the log line above it
// already carries the group's prefix and the error, and a long table buries both.
struct FlightFormat {
  size_t lastRows = SIZE_MAX;     // at most this many entries, up to `lastId`
  uint64_t lastId = UINT64_MAX;   // the newest entry shown (the failed op; ops queued
                                  // after it are counted, not shown)
  std::string prefix;             // dropped from the start of each entry's detail
  std::string shownAbove;         // an error equal to it reads "(the error above)"
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity);

  uint64_t record(uint64_t seq, std::string op, std::string detail, std::string path);
  void start(uint64_t id);
  void finish(uint64_t id, bool ok, uint32_t stepsDone, const std::string& path,
              const std::string& error);

  std::vector<FlightEntry> snapshot() const;
  // A table, one line per entry, oldest first.
  std::string format(const FlightFormat& how = FlightFormat()) const;
  // Writes format() to `dir`/`fileName`; returns the path, or "" when it could not.
  std::string dump(const std::string& dir, const std::string& fileName) const;

 private:
  FlightEntry* find(uint64_t id);
  double nowMs() const;

  size_t capacity_;
  std::chrono::steady_clock::time_point epoch_;
  mutable std::mutex mu_;
  std::deque<FlightEntry> entries_;
  uint64_t nextId_ = 0;
};

} // namespace tdx
