// Deadlines for point-to-point ops that are waited for through their future.
//
// A point-to-point op has no deadline of its own: a receive may be posted long before its
// message comes, so the group timeout starts when wait() is called. A caller that waits
// through the future instead (get_future().wait(), a .then() callback, as DDP comm hooks
// and pipeline schedules do) never calls wait(), and the op would wait for as long as
// its peer lives. For those the clock starts at get_future(), and one thread per process
// ends each op at its deadline as a wait() that timed out would.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace tdx {

class WorkTDX;

namespace futureDeadlines {

// Calls work->expire() at `at` unless disarm(work) ran first. The work is held weakly,
// which in c10 keeps the object (not its completion) until the deadline or disarm().
void arm(std::chrono::steady_clock::time_point at, const c10::intrusive_ptr<WorkTDX>& work);
// Forgets `work`'s deadline (it completed).
void disarm(const WorkTDX* work);

} // namespace futureDeadlines
} // namespace tdx
