// Helper threads for the memory passes of one rank's shared-memory collectives.
//
// On a host whose cores outnumber the ranks of a window, one thread per rank copies and
// reduces at a fraction of what the host's memory gives several threads (the 16-core
// GPU test host: 12.4 GB/s for one thread, 41.7 GB/s for four; docs/PERFORMANCE.md).
// A rank can then split each pass (a copy into or out of the window, a reduction) over
// helper threads of its process. The helpers are shared by the process's groups; a pass
// that finds them busy with another group's runs on its caller alone.
#pragma once

#include <cstddef>

#include "common/host.h"

namespace tdx {
namespace algorithms {

// The most threads a pass splits over, the caller included (common/host.h).
using tdx::kMaxPassThreads;

// How many ways parallelPass splits a pass of `bytes` with `ways` threads: parts under
// 64 KiB are not worth waking a helper for, and the pool has at most 16 threads. The cost
// model prices the split with it too.
int passWays(size_t bytes, int ways);

namespace detail {

// The pool's side of parallelPass: runs the parts through `call(fn, begin, end)` and
// returns true, or returns false (nothing run) when the pass is not worth splitting or
// another thread holds the helpers.
bool splitPass(size_t bytes, size_t grain, int ways,
               void (*call)(const void* fn, size_t begin, size_t end), const void* fn);

} // namespace detail

// Runs fn(begin, end) over [0, bytes) in up to `ways` contiguous parts, cut at multiples
// of `grain` (a whole number of elements and blocks), the calling thread taking the
// first part; returns when every part is done. fn must not throw. Parts smaller than
// 64 KiB are not worth waking a helper for: such passes, and any pass with `ways` <= 1
// or while another thread holds the helpers, run as fn(0, bytes) on the caller, with
// nothing allocated or locked on the way.
template <class Fn>
void parallelPass(size_t bytes, size_t grain, int ways, const Fn& fn) {
  auto call = [](const void* f, size_t begin, size_t end) {
    (*static_cast<const Fn*>(f))(begin, end);
  };
  if (ways <= 1 || !detail::splitPass(bytes, grain, ways, call, &fn)) fn(size_t{0}, bytes);
}

} // namespace algorithms
} // namespace tdx
