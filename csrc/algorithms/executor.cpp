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

// Throws unless `s` lies inside the memory it names. A plan is built from the byte
// counts its caller passed; a plan that disagreed with the buffers would read or write
// past a tensor, so every span is checked before any transfer starts (a peer then never
// sees part of such an op).
void checkSpan(const Span& s, const Buffers& b, size_t scratchBytes, size_t step,
               const char* end) {
  if (s.bytes == 0) return;
  size_t size = 0;
  const char* name = "";
  switch (s.region) {
    case Region::Data:
      size = b.dataBytes;
      name = "data";
      break;
    case Region::Scratch:
      size = scratchBytes;
      name = "scratch";
      break;
    case Region::Send:
    case Region::Recv: {
      const auto& blocks = s.region == Region::Send ? b.send : b.recv;
      name = s.region == Region::Send ? "send block" : "recv block";
      if (s.block < 0 || static_cast<size_t>(s.block) >= blocks.size()) {
        throw std::logic_error("plan step " + std::to_string(step) + ": " + end + " names " +
                               name + " " + std::to_string(s.block) + " of " +
                               std::to_string(blocks.size()));
      }
      size = blocks[s.block].bytes;
      break;
    }
  }
  if (s.offset > size || s.bytes > size - s.offset) {
    throw std::logic_error("plan step " + std::to_string(step) + ": " + end + " spans bytes [" +
                           std::to_string(s.offset) + ", " + std::to_string(s.offset + s.bytes) +
                           ") of a " + name + " of " + std::to_string(size) + " bytes");
  }
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
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    size_t need = 0, scaled = 0;
    for (const auto& a : step.actions) {
      if (a.verb != Verb::Recv && a.verb != Verb::RecvReduce) {
        checkSpan(a.src, buffers, plan.scratchBytes, s, "its source");
      }
      if (a.verb != Verb::Send) checkSpan(a.dst, buffers, plan.scratchBytes, s, "its destination");
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
