#pragma once

// A group's own corner of a store that may hold an earlier attempt's keys.
//
// torchrun --max-restarts (and any launcher that keeps its store across restarts) hands
// the restarted ranks the store of the attempt that failed, under the same prefix: every
// key the old group wrote (addresses of dead processes, window names, timeout notes) is
// still there, and a new rank can read it before its own peer overwrites it. The group
// therefore first agrees on a generation no earlier attempt can have used, and keeps all
// its keys under it.
//
// Rank 0 draws the generation. Every other rank draws a nonce of its own and publishes it
// with its identity (the members it named); rank 0 answers each join it reads with
// "nonce:generation:identity", and a rank takes the generation only from an answer to its
// own nonce, after checking rank 0's identity against its own, then confirms it (or
// refuses it, and rank 0 raises too). Rank 0 keeps answering until every rank has
// confirmed its generation, and then says it is done (or why it gave up); the others
// wait for that, so a rank that never comes is named as the late one on every rank. Keys left by earlier attempts carry other nonces
// and other generations, so no rank mistakes them for this attempt's.
//
// Ranks that passed new_group different lists share the group's name and keys, and
// fail naming the difference. At once where they meet in time: a joiner whose place
// another process took (its join text overwritten after its own write), or whom a live
// rank 0 of other members founds (rank 0's record, renewed every second and when its
// group is formed, under a number newer than the join). A joiner that came after rank 0
// formed its group finds out at its timeout, from rank 0's last record.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tdx {

struct GenerationHooks {
  std::string prefix;  // the group's log prefix, for errors
  // This rank's record of the group it creates (fixed width, no ':' or '|').
  std::string identity;
  // Called after each pause with the ranks awaited (those that have not confirmed; rank
  // 0 alone, for a rank waiting for rank 0's answer or end), the store key waited on
  // (ending in '/' when the rank's number follows, '@' when the key is whole) and what
  // the awaited ranks have not done; throws to give up: the caller's deadline and its
  // watch on lost ranks.
  std::function<void(const std::vector<int>&, const std::string&, const char*)> late;
  // Whether the caller's deadline has passed: rank 0 then checks the joins at hand with
  // `differs`, to say why a rank did not come when the reason may be known.
  std::function<bool()> due;
  // Rank r's identity as read: throws when it is not what this rank's group expects.
  std::function<void(int, const std::string&)> differs;
};

// The store prefix of a generation's keys, "tdx/<16 hex digits>".
std::string generationPrefix(uint64_t generation);

// The generation every rank of the group agrees on (a collective over the store).
uint64_t agreeOnGeneration(c10d::Store& store, int rank, int size, const GenerationHooks& hooks);

} // namespace tdx
