#include "parallel/flat_layout.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace tdx::parallel {

namespace {

int64_t roundUp(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

} // namespace

FlatLayout::FlatLayout(std::vector<int64_t> numels, int64_t worldSize, int64_t bucketNumel,
                       int64_t align)
    : worldSize_(worldSize) {
  if (worldSize < 1) {
    throw std::invalid_argument("world size must be at least 1, not " + std::to_string(worldSize));
  }
  if (bucketNumel < 1) {
    throw std::invalid_argument("bucket size must be at least 1 element, not " +
                                std::to_string(bucketNumel));
  }
  if (align < 1) {
    throw std::invalid_argument("alignment must be at least 1 element, not " +
                                std::to_string(align));
  }
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      throw std::invalid_argument("parameter " + std::to_string(i) + " has " +
                                  std::to_string(numels[i]) + " elements");
    }
  }
  const int64_t unit = worldSize * align;
  params_.reserve(numels.size());
  BucketSlot open{0, 0, 0, 0, 0, 0};
  int64_t used = 0;  // elements of the open bucket taken so far, alignment gaps included
  auto close = [&](int64_t last) {
    open.lastParam = last;
    open.numel = roundUp(used, unit);
    open.shardNumel = open.numel / worldSize;
    open.shardOffset = shardNumel_;
    buckets_.push_back(open);
    numel_ += open.numel;
    shardNumel_ += open.shardNumel;
  };
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t start = roundUp(used, align);
    const bool hasParams = static_cast<int64_t>(i) > open.firstParam;
    if (hasParams && start + numels[i] > bucketNumel) {
      close(static_cast<int64_t>(i));
      open = BucketSlot{static_cast<int64_t>(i), 0, numel_, 0, 0, 0};
      used = 0;
    }
    const int64_t at = roundUp(used, align);
    params_.push_back(
        ParamSlot{static_cast<int64_t>(buckets_.size()), open.offset + at, numels[i]});
    used = at + numels[i];
  }
  if (!numels.empty()) close(static_cast<int64_t>(numels.size()));
}

int64_t FlatLayout::ownedNumel(int64_t rank) const {
  if (rank < 0 || rank >= worldSize_) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is not in a world of " +
                                std::to_string(worldSize_));
  }
  int64_t owned = 0;
  for (const auto& b : buckets_) {
    const int64_t lo = b.offset + rank * b.shardNumel;
    const int64_t hi = lo + b.shardNumel;
    for (int64_t p = b.firstParam; p < b.lastParam; ++p) {
      const int64_t from = std::max(lo, params_[p].offset);
      const int64_t to = std::min(hi, params_[p].offset + params_[p].numel);
      if (to > from) owned += to - from;
    }
  }
  return owned;
}

std::string FlatLayout::describe() const {
  std::ostringstream out;
  out << params_.size() << " parameters, " << buckets_.size() << " buckets, " << numel_
      << " elements (" << shardNumel_ << " per rank of " << worldSize_ << ")";
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& s = buckets_[b];
    out << "\n  bucket " << b << ": parameters " << s.firstParam << ".." << s.lastParam - 1
        << ", elements [" << s.offset << ", " << s.offset + s.numel << "), shard "
        << s.shardNumel;
  }
  return out.str();
}

BucketTracker::BucketTracker(std::vector<int64_t> bucketOfParam)
    : bucketOfParam_(std::move(bucketOfParam)), seen_(bucketOfParam_.size(), false) {
  int64_t buckets = 0;
  for (const auto b : bucketOfParam_) {
    if (b < 0) throw std::invalid_argument("bucket " + std::to_string(b) + " is negative");
    buckets = std::max(buckets, b + 1);
  }
  size_.assign(buckets, 0);
  for (const auto b : bucketOfParam_) ++size_[b];
  for (int64_t b = 0; b < buckets; ++b) {
    if (size_[b] == 0) {
      throw std::invalid_argument("bucket " + std::to_string(b) + " holds no parameter");
    }
  }
  pending_ = size_;
}

std::vector<int64_t> BucketTracker::mark(int64_t index) {
  if (index < 0 || index >= static_cast<int64_t>(seen_.size())) {
    throw std::out_of_range("parameter " + std::to_string(index) + " is not among the tracker's " +
                            std::to_string(seen_.size()));
  }
  if (seen_[index]) {
    throw std::logic_error("parameter " + std::to_string(index) +
                           " got a second gradient before the backward pass ended");
  }
  seen_[index] = true;
  ++marked_;
  --pending_[bucketOfParam_[index]];
  std::vector<int64_t> released;
  const auto count = static_cast<int64_t>(pending_.size());
  while (nextBucket_ < count && pending_[nextBucket_] == 0) released.push_back(nextBucket_++);
  return released;
}

std::vector<int64_t> BucketTracker::finish() {
  std::vector<int64_t> released;
  for (auto b = nextBucket_; b < static_cast<int64_t>(pending_.size()); ++b) released.push_back(b);
  pending_ = size_;
  std::fill(seen_.begin(), seen_.end(), false);
  nextBucket_ = 0;
  marked_ = 0;
  return released;
}

std::vector<int64_t> BucketTracker::missing() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < seen_.size(); ++i) {
    if (!seen_[i]) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

} // namespace tdx::parallel
