// One registry of every TDX_* environment knob: name, default and meaning.
// Everything that reads the environment goes through here so the README table and
// the init log stay complete (house rule 6).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tdx {
namespace env {

struct Knob {
  const char* name;
  const char* defaultValue;
  const char* help;
};

// All knobs, in the order the README lists them.
const std::vector<Knob>& knobs();

// Value of a registered knob (the default when unset). Throws on unregistered names so a
// typo in the code cannot silently read nothing.
std::string get(const char* name);
int64_t getInt(const char* name);

// "TDX_X=value (default), ..." for the init log.
std::string describe();

} // namespace env
} // namespace tdx
