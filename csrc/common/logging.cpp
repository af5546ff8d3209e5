#include "common/logging.h"

#include <cstdio>
#include <mutex>

#include "common/env.h"

namespace tdx {

static LogLevel parseLevel(const std::string& v) {
  if (v == "ERROR") return LogLevel::Error;
  if (v == "INFO") return LogLevel::Info;
  if (v == "DETAIL" || v == "DEBUG") return LogLevel::Detail;
  return LogLevel::Warn;
}

LogLevel logLevel() {
  static const LogLevel level = parseLevel(env::get("TDX_DEBUG"));
  return level;
}

void logLine(LogLevel level, const std::string& prefix, const std::string& message) {
  static std::mutex mu;
  static const char* names[] = {"ERROR", "WARN", "INFO", "DETAIL"};
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%s %s %s\n", prefix.c_str(), names[static_cast<int>(level)],
               message.c_str());
  std::fflush(stderr);
}

} // namespace tdx
