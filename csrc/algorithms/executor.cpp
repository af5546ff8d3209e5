#include "algorithms/executor.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/env.h"

namespace tdx {
namespace algorithms {

namespace {

char* resolve(const Span& s, const Buffers& b, char* scratch) {
  // Zero-byte transfers still need a valid address for the transport.
  static char empty = 0;
  if (s.bytes == 0) return &empty;
  switch (s.region) {
    case Region::Data:
      return b.data + s.offset;
    case Region::Scratch:
      return scratch + s.offset;
    case Region::Send:
      return b.send.at(s.block).data + s.offset;
    case Region::Recv:
      return b.recv.at(s.block).data + s.offset;
  }
  throw std::logic_error("bad plan region");
}

// A segment of a receive-and-reduce: where it lands, where it goes.
struct PendingReduce {
  RequestPtr request;
  char* staged;
  char* dst;
  size_t bytes;
};

} // namespace

size_t defaultSegmentBytes() {
  static const size_t kBytes = [] {
    int64_t v = env::getInt("TDX_SEGMENT_BYTES");
    return static_cast<size_t>(std::max<int64_t>(v, 4096));
  }();
  return kBytes;
}

void runPlan(Channel& ch, const Plan& plan, const Buffers& buffers, size_t elemSize,
             kernels::ReduceFn reduce, size_t segmentBytes, const kernels::Load& load) {
  // Segments hold whole elements so each can be reduced on its own.
  const size_t seg = std::max(elemSize, segmentBytes / elemSize * elemSize);
  size_t staging = 0;
  size_t loading = 0;  // scaled copies of input sent as it is
  for (const auto& step : plan.steps) {
    size_t need = 0, scaled = 0;
    for (const auto& a : step.actions) {
      // Callers check that a local copy's two ends agree; a plan that broke this would
      // write past its destination or leave part of it unwritten. Checked before any
      // transfer starts, so a peer never sees part of such an op.
      if (a.verb == Verb::Copy && a.src.bytes != a.dst.bytes) {
        throw std::logic_error("plan copies " + std::to_string(a.src.bytes) + " bytes into " +
                               std::to_string(a.dst.bytes));
      }
      if (a.verb == Verb::RecvReduce) need += a.dst.bytes;
      if (a.verb == Verb::Send && a.src.region == Region::Send && load.scales) scaled += a.src.bytes;
    }
    staging = std::max(staging, need);
    loading = std::max(loading, scaled);
  }
  char* scratch = ch.scratch(plan.scratchBytes + staging + loading);
  char* stage = scratch + plan.scratchBytes;
  char* loaded = stage + staging;

  std::vector<RequestPtr> plain;
  std::vector<PendingReduce> reducing;
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    const uint32_t tag = static_cast<uint32_t>(s);
    size_t staged = 0, scaled = 0;
    for (const auto& a : step.actions) {
      if (a.verb != Verb::Recv && a.verb != Verb::RecvReduce) continue;
      char* dst = resolve(a.dst, buffers, scratch);
      if (a.dst.bytes == 0) {
        // Zero-byte messages still pair up, so the step's ordering holds.
        plain.push_back(ch.irecv(a.peer, tag, dst, 0));
        continue;
      }
      if (a.verb == Verb::Recv) {  // one message: see Action::segmented
        plain.push_back(ch.irecv(a.peer, tag, dst, a.dst.bytes));
        continue;
      }
      for (size_t off = 0; off < a.dst.bytes; off += seg) {
        const size_t n = std::min(seg, a.dst.bytes - off);
        char* into = stage + staged;
        staged += n;
        reducing.push_back({ch.irecv(a.peer, tag, into, n), into, dst + off, n});
      }
    }
    for (const auto& a : step.actions) {
      if (a.verb != Verb::Send) continue;
      const char* src = resolve(a.src, buffers, scratch);
      if (a.src.bytes == 0) {
        plain.push_back(ch.isend(a.peer, tag, src, 0));
        continue;
      }
      if (a.src.region == Region::Send && load.scales) {
        char* into = loaded + scaled;
        scaled += a.src.bytes;
        load(into, src, a.src.bytes);
        src = into;
      }
      const size_t cut = a.segmented ? seg : a.src.bytes;
      for (size_t off = 0; off < a.src.bytes; off += cut) {
        plain.push_back(ch.isend(a.peer, tag, src + off, std::min(cut, a.src.bytes - off)));
      }
    }
    for (auto& p : reducing) {
      ch.wait(p.request);
      if (reduce == nullptr) throw std::logic_error("plan reduces but the op has no reduce");
      reduce(p.dst, p.staged, p.bytes / elemSize);
    }
    reducing.clear();
    ch.waitAll(plain);
    for (const auto& a : step.actions) {
      if (a.verb == Verb::Copy) {
        if (a.src.bytes == 0) continue;
        char* dst = resolve(a.dst, buffers, scratch);
        const char* src = resolve(a.src, buffers, scratch);
        if (a.src.region == Region::Send) {
          load(dst, src, a.src.bytes);
        } else if (dst != src) {
          std::memmove(dst, src, a.src.bytes);
        }
      } else if (a.verb == Verb::Reduce) {
        if (a.src.bytes == 0) continue;
        if (reduce == nullptr) throw std::logic_error("plan reduces but the op has no reduce");
        char* dst = resolve(a.dst, buffers, scratch);
        const char* src = resolve(a.src, buffers, scratch);
        if (a.src.region == Region::Send && load.scales) {
          load.reduce(dst, src, a.src.bytes, reduce);
        } else {
          reduce(dst, src, a.src.bytes / elemSize);
        }
      }
    }
  }
}

const char* verbName(Verb v) {
  switch (v) {
    case Verb::Send:
      return "send";
    case Verb::Recv:
      return "recv";
    case Verb::RecvReduce:
      return "recv_reduce";
    case Verb::Copy:
      return "copy";
    case Verb::Reduce:
      return "reduce";
  }
  return "?";
}

const char* regionName(Region r) {
  switch (r) {
    case Region::Data:
      return "data";
    case Region::Send:
      return "send";
    case Region::Recv:
      return "recv";
    case Region::Scratch:
      return "scratch";
  }
  return "?";
}

} // namespace algorithms
} // namespace tdx
