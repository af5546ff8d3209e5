// Flat buffers for sharded data parallelism (ZeRO): where each parameter lives in one
// flat buffer, how that buffer splits into buckets, and which part of each bucket a
// rank owns.
//
// Parameters are laid out in the order given (the caller passes them in the order their
// gradients are expected, roughly the reverse of the forward pass), each at an offset
// aligned to `align` elements. A bucket takes parameters until the next one would push
// it past `bucketNumel` (a parameter larger than that gets a bucket of its own), and is
// padded to a multiple of worldSize * align, so that it splits into worldSize equal,
// aligned shards: rank r owns [r * shard, (r + 1) * shard) of every bucket. One
// reduce_scatter per bucket then hands each rank the reduced gradient of exactly the
// elements it owns, and one all_gather per bucket spreads the updated elements back.
//
// A rank's shard buffer is the concatenation of its shards of every bucket, in bucket
// order; every rank's has the same size, and bucket b's shard sits at the same offset in
// each. Padding is zero and stays zero: it is never a parameter's element.
//
// No torch, no communication: pure arithmetic, tested exhaustively in one process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tdx::parallel {

struct ParamSlot {
  int64_t bucket;  // the bucket that holds the parameter
  int64_t offset;  // first element, in the flat buffer
  int64_t numel;
};

struct BucketSlot {
  int64_t firstParam;   // parameters [firstParam, lastParam) of the layout's order
  int64_t lastParam;
  int64_t offset;       // first element, in the flat buffer
  int64_t numel;        // padded: a multiple of worldSize * align
  int64_t shardNumel;   // numel / worldSize
  int64_t shardOffset;  // first element of this bucket's shard, in a rank's shard buffer
};

class FlatLayout {
 public:
  // Throws std::invalid_argument, naming the argument, for a negative numel or a
  // worldSize, bucketNumel or align below 1.
  FlatLayout(std::vector<int64_t> numels, int64_t worldSize, int64_t bucketNumel, int64_t align);

  const std::vector<ParamSlot>& params() const { return params_; }
  const std::vector<BucketSlot>& buckets() const { return buckets_; }
  int64_t worldSize() const { return worldSize_; }
  int64_t numel() const { return numel_; }            // the flat buffer, padding included
  int64_t shardNumel() const { return shardNumel_; }  // one rank's shard buffer
  // Elements of parameters (not padding) in rank's shard: the optimizer state it keeps.
  int64_t ownedNumel(int64_t rank) const;
  // One line per bucket: its parameters, its span and the shard size.
  std::string describe() const;

 private:
  std::vector<ParamSlot> params_;
  std::vector<BucketSlot> buckets_;
  int64_t worldSize_;
  int64_t numel_ = 0;
  int64_t shardNumel_ = 0;
};

// Which buckets may start their reduce_scatter as gradients arrive during one backward.
// Every rank must issue its buckets' collectives in the same order, whatever order its
// gradients come in, so a bucket is released only once it is complete and every bucket
// before it has been released. `finish()` releases what is left at the end of the
// backward (parameters that got no gradient count as zero).
//
// Buckets are numbered in the order they are released, across any number of layouts (one
// per dtype and optimizer group): `bucketOfParam[i]` is parameter i's bucket, and every
// bucket 0..n-1 holds at least one parameter.
class BucketTracker {
 public:
  // Throws std::invalid_argument for a bucket number out of [0, n) or a bucket with no
  // parameter.
  explicit BucketTracker(std::vector<int64_t> bucketOfParam);

  // Parameter `index` has its gradient. Returns the buckets this releases, in order. A
  // parameter marked twice in one backward throws std::logic_error (its hook ran twice:
  // the graph reached it in two backward passes with no finish() between).
  std::vector<int64_t> mark(int64_t index);
  // The buckets not yet released, in order; then the tracker is ready for the next pass.
  std::vector<int64_t> finish();
  // Parameters not marked since the last finish(), in order.
  std::vector<int64_t> missing() const;
  bool started() const { return marked_ > 0; }

 private:
  std::vector<int64_t> bucketOfParam_;
  std::vector<int64_t> size_;     // per bucket: its parameters
  std::vector<int64_t> pending_;  // per bucket: parameters still to arrive
  std::vector<bool> seen_;
  int64_t nextBucket_ = 0;        // the first bucket not yet released
  int64_t marked_ = 0;
};

} // namespace tdx::parallel
