#include "common/host.h"

#include <sched.h>

namespace tdx {

int usableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

} // namespace tdx
