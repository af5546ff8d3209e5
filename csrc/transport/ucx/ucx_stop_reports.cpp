#include "transport/ucx/ucx_stop_reports.h"

#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace tdx {
namespace transport {
namespace {

thread_local StopReportsCounter::Counts* tActive = nullptr;

// UCX calls handlers newest first; CONTINUE hands the message on to its printer.
ucs_log_func_rc_t countStopReports(const char* /*file*/, unsigned /*line*/,
                                   const char* /*function*/, ucs_log_level_t level,
                                   const ucs_log_component_config_t* /*comp*/,
                                   const char* format, va_list ap) {
  StopReportsCounter::Counts* counts = tActive;
  if (counts == nullptr || level != UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;
  char text[512];
  va_list copy;  // the printer after this handler reads `ap` again
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  if (std::strstr(text, "was not returned to mpool") != nullptr) {
    ++counts->objects;
  } else if (std::strstr(text, "destroying inuse region") != nullptr) {
    ++counts->regions;
  } else if (std::strstr(text, "unexpected tag-receive descriptor") != nullptr) {
    ++counts->messages;
  } else {
    return UCS_LOG_FUNC_RC_CONTINUE;
  }
  return UCS_LOG_FUNC_RC_STOP;
}

} // namespace

StopReportsCounter::StopReportsCounter() {
  // Installed once for the process and left in place: UCX keeps a fixed array of
  // handlers, and one that does nothing off the stopping thread costs a load.
  static std::once_flag installed;
  std::call_once(installed, [] { ucs_log_push_handler(countStopReports); });
  tActive = &counts_;
}

StopReportsCounter::~StopReportsCounter() {
  tActive = nullptr;
}

} // namespace transport
} // namespace tdx
