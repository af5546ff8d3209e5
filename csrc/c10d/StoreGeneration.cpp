#include "c10d/StoreGeneration.hpp"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <sstream>
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
// entropy, mixed with the pid and the clock in case it has little.
uint64_t freshBits() {
  std::random_device device;
  uint64_t v = (static_cast<uint64_t>(device()) << 32) ^ device();
  v ^= static_cast<uint64_t>(getpid()) * 0x9e3779b97f4a7c15ull;
  v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count()) * 0xbf58476d1ce4e5b9ull;
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

// Pauses between polls: short while answers are coming, up to `longest` when a rank is
// late (a group's set-up waits for its slowest rank anyway).
struct Backoff {
  explicit Backoff(std::chrono::microseconds longest) : longest(longest) {}
  std::chrono::microseconds longest;
  std::chrono::microseconds pause{200};
  void progress() { pause = std::chrono::microseconds(200); }
  void wait() {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, longest);
  }
};

// Rank 0 sweeps every awaited rank's keys in one pause; the others wait on one key each,
// a few requests a second at most once it is late (as setupWait).
constexpr std::chrono::microseconds kLeadPause{16000};
constexpr std::chrono::microseconds kJoinPause{256000};
const char* const kFounder = "tdx/generation/founder";
const char* const kFounderSeq = "tdx/generation/seq";

// The identity in a join text ("nonce|identity") or founder record ("seq|identity"), or
// "" when it has none.
std::string afterBar(const std::string& t) {
  const size_t bar = t.find('|');
  return bar == std::string::npos ? std::string() : t.substr(bar + 1);
}

[[noreturn]] void fail(const GenerationHooks& hooks, const std::string& what) {
  C10_THROW_ERROR(DistBackendError, hooks.prefix + " " + what);
}

// A rank other than 0, having confirmed `generation`: waits until rank 0 has every
// rank's confirmation, so that a rank which never comes is named as such on every rank
// (not rank 0, still waiting for it here, for its later keys). The ranks awaited are
// those rank 0 has not listed as joined yet. Rank 0's failure ends the wait at once.
void awaitTheRest(c10d::Store& store, int rank, int size, const std::string& generation,
                  const GenerationHooks& hooks) {
  const std::string done = "tdx/" + generation + "/generation/done";
  const std::string joined = "tdx/" + generation + "/generation/joined";
  Backoff backoff(kJoinPause);
  for (;;) {
    if (store.check({done})) {
      const std::string d = text(store.get(done));
      if (!d.empty() && d[0] == '!') {
        fail(hooks, "rank 0 gave up creating the group: " + d.substr(1));
      }
      return;
    }
    std::vector<char> in(size, 0);
    in[0] = in[rank] = 1;
    if (store.check({joined})) {
      std::stringstream list(text(store.get(joined)));
      for (std::string q; std::getline(list, q, ',');) {
        const int r = std::atoi(q.c_str());
        if (r >= 0 && r < size) in[r] = 1;
      }
    }
    std::vector<int> awaited;
    for (int q = 0; q < size; ++q) {
      if (!in[q]) awaited.push_back(q);
    }
    if (awaited.empty()) {
      hooks.late({0}, "tdx/" + generation + "/generation/done@");  // rank 0 is to say
    } else {
      hooks.late(awaited, "tdx/generation/confirm/");
    }
    backoff.wait();
  }
}

uint64_t leadGeneration(c10d::Store& store, int size, const GenerationHooks& hooks) {
  const uint64_t generation = freshBits();
  const std::string mine = hex(generation);
  const std::string joinedKey = "tdx/" + mine + "/generation/joined";
  const std::string doneKey = "tdx/" + mine + "/generation/done";
  try {
    // Rewritten about every second under a new number: a rank that joined before the
    // latest number knows the record is this live rank's, not an earlier group's, and
    // can tell that it named other members even when no answer comes (its place is
    // beyond this group's size).
    auto founded = Clock::now();
    const auto found = [&] {
      const int64_t seq = store.add(kFounderSeq, 1);
      store.set(kFounder, bytes(std::to_string(seq) + "|" + hooks.identity));
      founded = Clock::now();
    };
    found();
    std::vector<std::string> answered(size);  // the join text answered last, per rank
    std::vector<char> confirmed(size, 0);
    confirmed[0] = 1;
    int left = size - 1;
    Backoff backoff(kLeadPause);
    for (;;) {
      if (Clock::now() - founded >= std::chrono::seconds(1)) found();
      bool joinedMore = false;
      for (int q = 1; q < size; ++q) {
        if (confirmed[q]) continue;
        if (store.check({key("confirm", q)})) {
          const std::string c = text(store.get(key("confirm", q)));
          if (c == mine) {
            confirmed[q] = 1;
            --left;
            joinedMore = true;
            continue;
          }
          if (c == "!" + mine) {  // it refused this rank's answer: they named other members
            hooks.differs(q, afterBar(answered[q]));
            fail(hooks, "rank " + std::to_string(q) + " refused to join: it named other "
                        "members; every rank of a group must pass new_group the same ranks");
          }
        }
        // A join text may be an earlier attempt's: answered all the same, since only its
        // own rank takes an answer, and only to its own nonce.
        if (!store.check({key("join", q)})) continue;
        const std::string join = text(store.get(key("join", q)));
        if (join != answered[q]) {
          const std::string nonce = join.substr(0, join.find('|'));
          store.set(key("answer", q), bytes(nonce + ":" + mine + ":" + hooks.identity));
          answered[q] = join;
          backoff.progress();
        }
      }
      if (joinedMore) {
        backoff.progress();
        std::string list;
        for (int p = 0; p < size; ++p) {
          if (confirmed[p]) list += (list.empty() ? "" : ",") + std::to_string(p);
        }
        store.set(joinedKey, bytes(list));
      }
      if (left == 0) {
        store.set(doneKey, bytes("1"));
        found();  // for ranks that named other members and join after the answers
        return generation;
      }
      std::vector<int> awaited;
      for (int q = 1; q < size; ++q) {
        if (confirmed[q]) continue;
        awaited.push_back(q);
        // At the deadline, a join of a rank that named other members hints at why it
        // never confirmed (the join may be an earlier group's: a hint only).
        if (!answered[q].empty() && hooks.due()) hooks.differs(q, afterBar(answered[q]));
      }
      hooks.late(awaited, "tdx/generation/confirm/");
      backoff.wait();
    }
  } catch (const std::exception& e) {
    // The ranks that confirmed wait for the end: they learn why at once (the message
    // without torch's C++ backtrace).
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    try {
      store.set(doneKey, bytes(std::string("!") +
                               (error ? error->what_without_backtrace() : e.what())));
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
  Backoff backoff(kJoinPause);
  for (;;) {
    if (store.check({key("answer", rank)})) {
      // "nonce:generation:identity"
      const std::string answer = text(store.get(key("answer", rank)));
      const size_t colon = nonce.size() + 1 + 16;
      if (answer.size() > colon && answer.compare(0, nonce.size(), nonce) == 0 &&
          answer[nonce.size()] == ':' && answer[colon] == ':') {
        const std::string generation = answer.substr(nonce.size() + 1, 16);
        try {
          hooks.differs(0, answer.substr(colon + 1));
        } catch (...) {  // rank 0 named other members: refused, and rank 0 told so
          store.set(key("confirm", rank), bytes("!" + generation));
          throw;
        }
        store.set(key("confirm", rank), bytes(generation));
        awaitTheRest(store, rank, size, generation, hooks);
        return std::stoull(generation, nullptr, 16);
      }
    }
    // Written after this rank's own join, a join text of another is a live process's
    // claim to this rank's place: a rank of a group of the same name that named other
    // members.
    const std::string now = text(store.get(key("join", rank)));
    if (now != join) {
      hooks.differs(rank, afterBar(now));
      fail(hooks, "another process joined the group as rank " + std::to_string(rank) +
                      ": every rank of a group must pass new_group the same ranks");
    }
    // A founder record newer than this rank's join is the live rank 0's. At the deadline
    // any is read: an older one may be an earlier group's, but no answer came, and rank
    // 0 may have formed its group of other members before this rank joined.
    if (store.check({kFounder})) {
      const std::string founder = text(store.get(kFounder));
      if (std::atoll(founder.c_str()) > joinedAt || hooks.due()) {
        hooks.differs(0, afterBar(founder));
      }
    }
    hooks.late({0}, key("answer", rank) + "@");
    backoff.wait();
  }
}

} // namespace

uint64_t agreeOnGeneration(c10d::Store& store, int rank, int size,
                           const GenerationHooks& hooks) {
  if (size == 1) return freshBits();  // nobody to agree with, and no key to read
  return rank == 0 ? leadGeneration(store, size, hooks) : joinGeneration(store, rank, size, hooks);
}

} // namespace tdx
