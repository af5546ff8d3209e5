// Facts about the host this process runs on.
#pragma once

namespace tdx {

// CPUs this process may run on (its affinity mask; 1 when the mask cannot be read). Ranks
// of one host that outnumber them take turns on the cores, so waiting by polling steals
// the core a peer needs, and every step that waits for a peer waits for it to be
// scheduled.
int usableCpus();

} // namespace tdx
