#include "c10d/StoreGeneration.hpp"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

namespace tdx {

namespace {

using Clock = std::chrono::steady_clock;

std::string hex(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// 64 bits no other process (nor an earlier one of this pid) draws alike: the device's
// entropy, mixed with the pid and the clock in case it has little (or none to give).
uint64_t freshBits() {
  uint64_t v = 0;
  try {
    std::random_device device;
    v = (static_cast<uint64_t>(device()) << 32) ^ device();
  } catch (const std::exception&) {  // no entropy source: the pid and clocks alone
  }
  v ^= static_cast<uint64_t>(getpid()) * 0x9e3779b97f4a7c15ull;
  v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0xbf58476d1ce4e5b9ull;
  v ^= static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return v == 0 ? 1 : v;
}

std::string text(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

std::vector<uint8_t> bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string key(const char* what, int q) {
  return std::string("tdx/generation/") + what + "/" + std::to_string(q);
}

bool isGeneration(const std::string& t) {
  return t.size() == 16 && t.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// Pauses between polls: short while answers are coming, up to `longest` when a rank is
// late (a group's set-up waits for its slowest rank anyway).
struct Backoff {
  explicit Backoff(std::chrono::microseconds longest) : longest(longest) {}
  std::chrono::microseconds longest;
  std::chrono::microseconds pause{1000};
  void progress() { pause = std::chrono::microseconds(1000); }
  void wait() {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, longest);
  }
};

// Each poll costs the store one or two requests: rank 0 reads a counter the others bump
// when they write a join or a confirmation, and sweeps their keys only when it moved (or
// every kSweepEvery); the others read their own answer, or rank 0's end. The records a
// rank reads only to fail sooner (its join overwritten, rank 0's founder record) are read
// once every kLookEvery.
constexpr std::chrono::microseconds kLeadPause{16000};
constexpr std::chrono::microseconds kJoinPause{256000};
constexpr std::chrono::milliseconds kSweepEvery{256};
constexpr std::chrono::milliseconds kLookEvery{1000};
const char* const kFounder = "tdx/generation/founder";
const char* const kFounderSeq = "tdx/generation/seq";
const char* const kEvents = "tdx/generation/events";

// What follows the first '|' ("nonce|identity", "!generation|identity"), or "".
std::string afterBar(const std::string& t) {
  const size_t bar = t.find('|');
  return bar == std::string::npos ? std::string() : t.substr(bar + 1);
}

// A founder record: "seq|identity", or "seq|identity|!reason" once rank 0 gave up.
struct Founder {
  int64_t seq = -1;
  std::string identity;
  std::string failure;  // why rank 0 gave up; "" while it has not
};

Founder readFounder(c10d::Store& store) {
  Founder f;
  if (!store.check({kFounder})) return f;
  const std::string t = text(store.get(kFounder));
  f.seq = std::atoll(t.c_str());
  std::string rest = afterBar(t);
  const size_t bar = rest.find('|');
  f.identity = rest.substr(0, bar);
  if (bar != std::string::npos && bar + 1 < rest.size() && rest[bar + 1] == '!') {
    f.failure = rest.substr(bar + 2);
  }
  return f;
}

[[noreturn]] void fail(const GenerationHooks& hooks, const std::string& what) {
  C10_THROW_ERROR(DistBackendError, hooks.prefix + " " + what);
}

// A rank other than 0, having confirmed `generation`: waits until rank 0 says every rank
// has confirmed, so that a rank which never comes is named as such on every rank (not
// rank 0, still waiting for it here, for its later keys). Rank 0's failure ends the wait
// at once. At the deadline the ranks that have not confirmed are read from the store.
void awaitTheRest(c10d::Store& store, int rank, int size, const std::string& generation,
                  const GenerationHooks& hooks) {
  const std::string done = "tdx/" + generation + "/generation/done";
  Backoff backoff(kJoinPause);
  for (;;) {
    if (store.check({done})) {
      const std::string d = text(store.get(done));
      if (!d.empty() && d[0] == '!') {
        fail(hooks, "rank 0 gave up creating the group: " + d.substr(1));
      }
      return;
    }
    std::vector<int> awaited;
    if (hooks.due()) {
      for (int q = 1; q < size; ++q) {
        if (q == rank) continue;
        if (!store.check({key("confirm", q)}) ||
            text(store.get(key("confirm", q))) != generation) {
          awaited.push_back(q);
        }
      }
    }
    if (awaited.empty()) {
      hooks.late({0}, done + "@", "finish creating the group");
    } else {
      hooks.late(awaited, "tdx/generation/confirm/", "join the group");
    }
    backoff.wait();
  }
}

uint64_t leadGeneration(c10d::Store& store, int size, const GenerationHooks& hooks) {
  const uint64_t generation = freshBits();
  const std::string mine = hex(generation);
  const std::string doneKey = generationPrefix(generation) + "/generation/done";
  // Rewritten about every second under a new number, and when the group is formed: a
  // rank that joined before the latest number knows the record is this live rank's, not
  // an earlier group's, and can tell that it named other members even when no answer
  // comes (its place is beyond this group's size), or that rank 0 gave up.
  auto founded = Clock::now();
  const auto found = [&](const std::string& failure) {
    const int64_t seq = store.add(kFounderSeq, 1);
    store.set(kFounder, bytes(std::to_string(seq) + "|" + hooks.identity +
                              (failure.empty() ? "" : "|!" + failure)));
    founded = Clock::now();
  };
  try {
    found("");
    std::vector<std::string> answered(size);  // the join text answered last, per rank
    std::vector<char> confirmed(size, 0);
    confirmed[0] = 1;
    int left = size - 1;
    int64_t events = -1;  // the counter at the last sweep
    auto swept = Clock::now();
    Backoff backoff(kLeadPause);
    for (;;) {
      if (Clock::now() - founded >= std::chrono::seconds(1)) found("");
      const int64_t now = store.add(kEvents, 0);
      const bool due = hooks.due();
      if (now != events || Clock::now() - swept >= kSweepEvery || due) {
        events = now;
        swept = Clock::now();
        for (int q = 1; q < size; ++q) {
          if (confirmed[q]) continue;
          if (store.check({key("confirm", q)})) {
            const std::string c = text(store.get(key("confirm", q)));
            if (c == mine) {
              confirmed[q] = 1;
              --left;
              backoff.progress();
              continue;
            }
            if (c.rfind("!" + mine + "|", 0) == 0) {
              // It refused this rank's answer, naming its own members: they differ.
              hooks.differs(q, afterBar(c));
              fail(hooks, "rank " + std::to_string(q) + " refused to join: it named other "
                          "members; every rank of a group must pass new_group the same ranks");
            }
          }
          // A join text may be an earlier attempt's: answered all the same, since only
          // its own rank takes an answer, and only to its own nonce.
          if (!store.check({key("join", q)})) continue;
          const std::string join = text(store.get(key("join", q)));
          if (join != answered[q]) {
            const std::string nonce = join.substr(0, join.find('|'));
            store.set(key("answer", q), bytes(nonce + ":" + mine + ":" + hooks.identity));
            answered[q] = join;
            backoff.progress();
          }
        }
      }
      if (left == 0) {
        store.set(doneKey, bytes("1"));
        found("");  // for ranks that named other members and join after the answers
        return generation;
      }
      std::vector<int> awaited;
      for (int q = 1; q < size; ++q) {
        if (confirmed[q]) continue;
        awaited.push_back(q);
        // At the deadline, a join of a rank that named other members hints at why it
        // never confirmed (the join may be an earlier group's: a hint only).
        if (!answered[q].empty() && due) hooks.differs(q, afterBar(answered[q]));
      }
      hooks.late(awaited, "tdx/generation/confirm/", "join the group");
      backoff.wait();
    }
  } catch (const std::exception& e) {
    // The ranks that confirmed wait for the end, those not answered yet for an answer:
    // both learn why at once (the message without torch's C++ backtrace).
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    const std::string why = error ? error->what_without_backtrace() : e.what();
    try {
      store.set(doneKey, bytes("!" + why));
      found(why);
    } catch (...) {  // the store itself failed: they find out through it too
    }
    throw;
  }
}

uint64_t joinGeneration(c10d::Store& store, int rank, int size, const GenerationHooks& hooks) {
  const int64_t joinedAt = store.add(kFounderSeq, 0);  // the founder records so far
  const std::string nonce = hex(freshBits());
  const std::string join = nonce + "|" + hooks.identity;
  store.set(key("join", rank), bytes(join));
  store.add(kEvents, 1);
  auto looked = Clock::now();
  Backoff backoff(kJoinPause);
  for (;;) {
    if (store.check({key("answer", rank)})) {
      // "nonce:generation:identity"
      const std::string answer = text(store.get(key("answer", rank)));
      const size_t colon = nonce.size() + 1 + 16;
      const std::string generation =
          answer.size() > colon ? answer.substr(nonce.size() + 1, 16) : std::string();
      if (answer.compare(0, nonce.size(), nonce) == 0 && answer[nonce.size()] == ':' &&
          isGeneration(generation) && answer[colon] == ':') {
        try {
          hooks.differs(0, answer.substr(colon + 1));
        } catch (...) {  // rank 0 named other members: refused, and rank 0 told so
          store.set(key("confirm", rank), bytes("!" + generation + "|" + hooks.identity));
          store.add(kEvents, 1);
          throw;
        }
        store.set(key("confirm", rank), bytes(generation));
        store.add(kEvents, 1);
        awaitTheRest(store, rank, size, generation, hooks);
        return std::strtoull(generation.c_str(), nullptr, 16);
      }
    }
    const bool due = hooks.due();
    if (Clock::now() - looked >= kLookEvery || due) {
      looked = Clock::now();
      // Written after this rank's own join, a join text of another is a live process's
      // claim to this rank's place: a rank of a group of the same name that named other
      // members.
      const std::string now = text(store.get(key("join", rank)));
      if (now != join) {
        fail(hooks, "another process joined the group as rank " + std::to_string(rank) +
                        " (its record: " + afterBar(now) + "; this rank's: " + hooks.identity +
                        "): every rank of a group must pass new_group the same ranks, and "
                        "create its groups in the same order as the others");
      }
      // A founder record newer than this rank's join is the live rank 0's. At the
      // deadline any is read: an older one may be an earlier group's (a hint), but no
      // answer came, and rank 0 may have formed a group of other members before this
      // rank joined.
      const Founder founder = readFounder(store);
      if (founder.seq > joinedAt && !founder.failure.empty()) {
        fail(hooks, "rank 0 gave up creating the group: " + founder.failure);
      }
      if (founder.seq >= 0 && (founder.seq > joinedAt || due)) {
        hooks.differs(0, founder.identity);
      }
    }
    hooks.late({0}, key("answer", rank) + "@", "join the group");
    backoff.wait();
  }
}

} // namespace

std::string generationPrefix(uint64_t generation) {
  return "tdx/" + hex(generation);
}

uint64_t agreeOnGeneration(c10d::Store& store, int rank, int size,
                           const GenerationHooks& hooks) {
  if (size == 1) return freshBits();  // nobody to agree with, and no key to read
  return rank == 0 ? leadGeneration(store, size, hooks) : joinGeneration(store, rank, size, hooks);
}

} // namespace tdx
