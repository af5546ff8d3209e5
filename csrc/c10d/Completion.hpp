// Where Work futures are completed. Completing a future runs its callbacks inline, and
// a callback may issue a collective and wait for it (torch's PowerSGD comm hook does).
// Done on a group's worker thread, that nested op would queue behind the blocked worker
// and never run; done on the transport's progress thread, nothing would progress at all.
// So completions run on a small pool of their own, which grows (up to a cap) when every
// thread is busy in a callback, so a nested op's completion always finds a thread.
#pragma once

#include <functional>

namespace tdx {

// Runs `fn` on a completion thread, soon. Never blocks the caller.
void postCompletion(std::function<void()> fn);

} // namespace tdx
