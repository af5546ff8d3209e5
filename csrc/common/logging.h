// Cheap leveled logging with the "[tdx r<rank>/<size> pg=<name>] <subsystem>:" prefix.
// The level is read once from TDX_DEBUG; checking it is one integer compare.
#pragma once

#include <sstream>
#include <string>

namespace tdx {

enum class LogLevel : int { Error = 0, Warn = 1, Info = 2, Detail = 3 };

LogLevel logLevel();
inline bool logEnabled(LogLevel l) {
  return static_cast<int>(l) <= static_cast<int>(logLevel());
}
void logLine(LogLevel level, const std::string& prefix, const std::string& message);

} // namespace tdx

// Usage: TDX_LOG(Info, prefix) << "chose ring for 4 MiB";
#define TDX_LOG(level, prefix)                                   \
  if (!::tdx::logEnabled(::tdx::LogLevel::level)) {              \
  } else                                                         \
    ::tdx::detail::LogStream(::tdx::LogLevel::level, (prefix)).os

namespace tdx {
namespace detail {
struct LogStream {
  LogLevel level;
  std::string prefix;
  std::ostringstream os;
  LogStream(LogLevel l, std::string p) : level(l), prefix(std::move(p)) {}
  ~LogStream() {
    logLine(level, prefix, os.str());
  }
};
} // namespace detail
} // namespace tdx
