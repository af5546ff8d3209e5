// Same-host peer-memory collectives on CUDA tensors (see DeviceOps.hpp).
//
// allreduce, one pass, in place. With N ranks and the tensor cut into N chunks, rank r
// reads chunk r of every rank's tensor (mapped through CUDA IPC), reduces it, and writes
// the result into chunk r of every rank's tensor. Each chunk is touched by exactly one
// rank, so no rank reads what another writes, and each byte of each buffer is read once
// and written once: the memory traffic of the whole op is the 2·N·S floor, which is what
// lets N ranks sharing one GPU approach the B·(N−1)/N² busbw limit.
//
// Two flag exchanges bracket the kernel, both on the backend stream in GPU memory:
//   arrive: "my tensor holds my input" (the stream has passed the caller's ready event);
//   done:   "I have finished writing my chunk into every tensor".
// A rank's stream moves past the op only when every peer is done, so the caller never
// sees a half-written tensor and never overwrites one a peer still reads.
//
// Before the device work, one host allgather over the group's channel (≈200 bytes per
// rank) carries each rank's IPC handles and eligibility; a second 1-byte allgather
// confirms the mappings only when some handle is new to the group.
#include "c10d/DeviceOps.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <sstream>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>
#include <vector>
#include <unistd.h>

#include "algorithms/collectives.h"
#include "common/env.h"
#include "common/logging.h"

#ifdef TDX_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/SmallVector.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "kernels/reduce_cuda.h"
#include "transport/peer_memory/cuda_ipc.h"
#endif

namespace tdx {

#ifdef TDX_WITH_CUDA
namespace {

namespace peer = transport::peer;

// Everything a rank tells the others before a peer-memory op. Plain bytes: it crosses
// the network as is, between processes of the same build.
constexpr int kMaxTensors = 2;  // an op's input and output

struct Advert {
  uint8_t eligible = 0;
  uint8_t pad[7] = {};
  uint64_t hostId = 0;
  uint64_t bytes[kMaxTensors] = {};
  uint64_t offset[kMaxTensors] = {};  // each tensor's start within its allocation
  char busId[32] = {};
  peer::IpcHandle signals{};
  peer::IpcHandle buffer[kMaxTensors] = {};
};

// Same host: the kernel's boot id (identical across containers of one machine, unlike
// the host name) and the host name (for systems without the file).
uint64_t thisHostId() {
  static const uint64_t id = [] {
    std::string key;
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::getline(boot, key);
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    key += host;
    return static_cast<uint64_t>(std::hash<std::string>{}(key));
  }();
  return id;
}

std::string handleKey(int rank, const peer::IpcHandle& h) {
  return std::to_string(rank) + ":" + std::string(h.bytes, sizeof(h.bytes));
}

// [lo, hi) of `count` elements of `elemSize` bytes that rank `r` of `n` owns. Chunks are
// whole 16-byte vectors so every chunk is as aligned as the tensor.
std::pair<size_t, size_t> chunkOf(size_t count, size_t elemSize, int n, int r) {
  const size_t align = std::max<size_t>(1, 16 / elemSize);
  const size_t per = (count + n - 1) / n;
  const size_t chunk = (per + align - 1) / align * align;
  const size_t lo = std::min(count, chunk * r);
  return {lo, std::min(count, lo + chunk)};
}

// Waits on the host for `stream`, but not past `deadline` (see pollUntil).
void syncUntil(cudaStream_t stream, std::chrono::steady_clock::time_point deadline,
               const std::string& what) {
  pollUntil(
      [&] {
        const cudaError_t e = cudaStreamQuery(stream);
        if (e == cudaSuccess || e == cudaErrorNotReady) return e == cudaSuccess;
        cudaGetLastError();  // clears a non-sticky error; a sticky one stays with the context
        throw std::runtime_error(what + ": CUDA error " + cudaGetErrorString(e));
      },
      deadline,
      what + ": the GPU did not finish within the group timeout (work queued before it is "
             "stuck)");
}

// Streams of the groups' own, not torch's pool: pool streams are shared round robin by
// every user of the device, so another group's op stuck on the same stream (waiting for
// its own lost peer) would hold this group's ops behind it. Non-blocking, so they never
// wait on the legacy default stream either.
//
// They are never destroyed: the caching allocator keeps the streams a tensor was
// recorded on and records an event on each when the tensor is freed, which may be after
// its group is gone. A group hands its streams back here when it ends with no device work
// pending, for the next group to take; with work still pending it keeps them for good.
class StreamPool {
 public:
  static StreamPool& instance() {
    static StreamPool* pool = new StreamPool();  // never destroyed: see above
    return *pool;
  }

  // Throws std::runtime_error when CUDA cannot create one.
  cudaStream_t take(c10::DeviceIndex device, bool highPriority) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[{device, highPriority}];
      if (!free.empty()) {
        cudaStream_t s = free.back();
        free.pop_back();
        return s;
      }
    }
    c10::cuda::CUDAGuard guard(device);
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking,
                                     highPriority ? greatest : least) != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error("could not create a CUDA stream for the peer-memory path");
    }
    return s;
  }

  void giveBack(c10::DeviceIndex device, bool highPriority, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[{device, highPriority}].push_back(s);
  }

 private:
  std::mutex mu_;
  std::map<std::pair<c10::DeviceIndex, bool>, std::vector<cudaStream_t>> free_;
};

// Signal page layout: kPhases rows of kSlots 64-bit flags; row `phase`, column `p` is
// written by rank p. Flags only grow (they hold the op's sequence number).
constexpr int kArrive = 0;
constexpr int kDone = 1;
constexpr int kPhases = 2;
constexpr int kSlots = kernels::kMaxMultiBuffers;

using WeakStorages = c10::SmallVector<c10::weak_intrusive_ptr<c10::StorageImpl>, kMaxTensors>;

// A group's op on GPU-side flags whose end event has not been seen yet.
struct Pending {
  std::shared_ptr<c10::Event> done;
  uint64_t seq;
  int ranks;
  c10::DeviceIndex device;
  std::chrono::steady_clock::time_point deadline;
  std::string what;
  // This rank's tensors of the op, weakly: holding them would keep memory the caller has
  // freed from serving its next allocation until the group's thread looks again. Inline
  // for an op's kMaxTensors, so recording them allocates nothing.
  WeakStorages storages;
};

WeakStorages weakly(const std::vector<at::Tensor>& ts) {
  WeakStorages out;
  for (const auto& t : ts) out.push_back(t.storage().getWeakStorageImpl());
  return out;
}

// Keeps the tensors of released ops that are still alive for the life of the process: a
// peer that was only slow, not gone, still writes its share into them through its
// mapping when its stream gets there, which must not land in memory the caching
// allocator has handed to another tensor since. (A tensor the caller freed while the op
// waited went back to the allocator then, and is reused once the released work passes
// it.) Never destroyed: at exit the allocator may already be gone.
void quarantine(const std::deque<Pending>& released) {
  static std::mutex mu;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10::StorageImpl>>();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& p : released) {
    for (const auto& weak : p.storages) {
      if (auto strong = weak.lock()) kept->push_back(std::move(strong));
    }
  }
}

// Raises this rank's copy of every flag to the highest pending sequence, so the stuck
// op and every op queued behind it on the backend stream (each waits on the same flags
// with a higher sequence) run to their end; their outputs are undefined. `side` is a
// stream other than the stuck one. Returns what the first op still waited for, naming
// the ranks whose flags never came. Requires a non-empty `pending`.
std::string raiseFlags(const std::deque<Pending>& pending, uint64_t* signals, cudaStream_t side,
                       int rank) {
  const Pending& p = pending.front();
  c10::cuda::CUDAGuard guard(p.device);
  std::vector<uint64_t> flags(kPhases * kSlots, 0);
  const size_t bytes = flags.size() * sizeof(uint64_t);
  // Ranks whose flag for the op never came are the cause; ranks that arrived but did
  // not finish are, as a rule, waiting on those too.
  std::vector<int> absent, unfinished;
  bool read = false;
  if (cudaMemcpyAsync(flags.data(), signals, bytes, cudaMemcpyDeviceToHost, side) ==
          cudaSuccess &&
      cudaStreamSynchronize(side) == cudaSuccess) {
    read = true;
    for (int r = 0; r < p.ranks; ++r) {
      if (r == rank) continue;
      if (flags[kArrive * kSlots + r] < p.seq) {
        absent.push_back(r);
      } else if (flags[kDone * kSlots + r] < p.seq) {
        unfinished.push_back(r);
      }
    }
  }
  uint64_t last = p.seq;
  for (const auto& q : pending) last = std::max(last, q.seq);
  for (auto& f : flags) f = std::max(f, last);
  cudaMemcpyAsync(signals, flags.data(), bytes, cudaMemcpyHostToDevice, side);
  cudaStreamSynchronize(side);
  cudaGetLastError();
  std::string told = "CUDA peer-memory op " + p.what + " (flag sequence " +
                     std::to_string(p.seq) + ") still waited";
  if (!read) {
    told += " (the flags could not be read)";
  } else if (!absent.empty()) {
    told += " for " + rankList(absent) + ", which never arrived" +
            (unfinished.empty() ? "" : " (" + rankList(unfinished) + " arrived, not finished)");
  } else if (!unfinished.empty()) {
    told += " for " + rankList(unfinished) + ", which arrived but never finished";
  }
  return told;
}

// The tensors of one op on every rank, mapped into this process, and the op's place in
// the group's flag sequence.
struct Mapped {
  std::vector<std::array<char*, kMaxTensors>> ptr;  // [rank][tensor]
  std::vector<uint64_t*> signals;                   // [rank]
  std::optional<c10::cuda::CUDAStream> stream;
  uint64_t seq = 0;
  bool hostSync = false;  // barriers on the host for this op (see map())
};

class CudaPeerMemory final : public PeerMemory {
 public:
  enum class Sync { Auto, Gpu, Host };

  CudaPeerMemory(int rank, int size, std::string prefix, Sync sync,
                 std::function<std::chrono::milliseconds()> timeout)
      : rank_(rank),
        size_(size),
        prefix_(std::move(prefix)),
        sync_(sync),
        timeout_(std::move(timeout)) {}

  ~CudaPeerMemory() override {
    // The peers' mappings, the signal page and the streams may only go once this rank's
    // device work is over: a kernel or flag write still queued would fault on an unmapped
    // peer buffer. What does not end keeps all of them for the life of the process.
    bool idle = false;
    try {
      idle = drain();
    } catch (...) {  // a destructor must not throw; the state is kept below
    }
    if (!idle) {
      maps_.abandon();
      return;
    }
    // Peers may still hold our signal page open; freeing it is safe (their mappings keep
    // the memory alive until they close them). cudaFree waits for the whole device, as
    // it always has: stuck work of another group still delays it.
    if (signals_) cudaFree(signals_);
    cudaGetLastError();
    for (const auto& [device, st] : streams_) StreamPool::instance().giveBack(device, true, st);
    for (const auto& [device, st] : sideStreams_) {
      StreamPool::instance().giveBack(device, false, st);
    }
  }

  uint64_t opsRun() const override {
    return opsRun_;
  }

  bool hasPending() override {
    try {
      while (!pending_.empty() && pending_.front().done->query()) pending_.pop_front();
    } catch (const std::exception& e) {
      // A sticky CUDA error (a faulted kernel) fails every query from now on. The worker
      // thread must not die of it: the group breaks with the error instead.
      if (deviceError_.empty()) {
        deviceError_ = "CUDA error while watching peer-memory op " + pending_.front().what +
                       ": " + e.what();
      }
      pending_.clear();
      enabled_ = false;
    }
    return !pending_.empty();
  }

  std::string releaseStalled() override {
    if (!deviceError_.empty() && !deviceErrorTold_) {
      deviceErrorTold_ = true;
      return deviceError_;
    }
    if (!hasPending()) return "";
    if (std::chrono::steady_clock::now() < pending_.front().deadline) return "";
    return releasePending() + " after the group timeout; this rank's stream was released, the "
                              "op's output is undefined";
  }

  // One pass, in place: rank r reduces chunk r of every rank's tensor and writes it back
  // into every rank's tensor.
  bool allreduce(GroupChannel& ch, const at::Tensor& t, const Reduction& red,
                 DeviceContext& ctx) override {
    c10::cuda::CUDAGuard guard(t.device());
    const bool ok = kernels::cudaReduceSupported(red.dtype, red.kind);
    Mapped m;
    if (!map(ch, {t}, ok, ctx, m)) return false;
    const int n = ch.size();
    const size_t es = t.element_size();
    auto [lo, hi] = chunkOf(t.numel(), es, n, ch.rank());
    kernels::MultiReduceArgs a = red.multiReduceArgs(n);
    for (int p = 0; p < n; ++p) {
      a.inputs[p] = m.ptr[p][0] + lo * es;
      a.outputs[p] = m.ptr[p][0] + lo * es;
    }
    a.numInputs = a.numOutputs = n;
    a.count = hi - lo;
    run(ch, m, a, {t}, ctx);
    return true;
  }

  // Rank r reduces block r of every rank's input into its own output: reads only.
  bool reduceScatter(GroupChannel& ch, const at::Tensor& out, const at::Tensor& in,
                     const Reduction& red, DeviceContext& ctx) override {
    c10::cuda::CUDAGuard guard(out.device());
    const bool ok = kernels::cudaReduceSupported(red.dtype, red.kind);
    Mapped m;
    if (!map(ch, {in, out}, ok, ctx, m)) return false;
    const int n = ch.size();
    const int me = ch.rank();
    const size_t block = out.numel() * out.element_size();
    kernels::MultiReduceArgs a = red.multiReduceArgs(n);
    for (int p = 0; p < n; ++p) a.inputs[p] = m.ptr[p][0] + me * block;
    a.numInputs = n;
    a.outputs[0] = m.ptr[me][1];
    a.numOutputs = 1;
    a.count = out.numel();
    run(ch, m, a, {in, out}, ctx);
    return true;
  }

  // Rank r writes its input into block r of every rank's output.
  bool allgather(GroupChannel& ch, const at::Tensor& out, const at::Tensor& in,
                 DeviceContext& ctx) override {
    c10::cuda::CUDAGuard guard(out.device());
    const int n = ch.size();
    const int me = ch.rank();
    const size_t block = in.numel() * in.element_size();
    // The kernel reads this rank's input while peers write their blocks of every output:
    // an input lying in another rank's block would be overwritten as it is read. Such a
    // rank stages (its input is copied before anything is written), and so, seeing its
    // advert, does every rank.
    const auto inAt = reinterpret_cast<uintptr_t>(in.data_ptr());
    const auto outAt = reinterpret_cast<uintptr_t>(out.data_ptr());
    const bool inOwnBlock = inAt == outAt + me * block;
    const bool inOtherBlock = !inOwnBlock && inAt < outAt + n * block && outAt < inAt + block;
    Mapped m;
    if (!map(ch, {in, out}, !inOtherBlock, ctx, m)) return false;
    kernels::MultiReduceArgs a = copy(block);
    a.inputs[0] = m.ptr[me][0];
    for (int p = 0; p < n; ++p) a.outputs[p] = m.ptr[p][1] + me * block;
    a.numOutputs = n;
    run(ch, m, a, {in, out}, ctx);
    return true;
  }

  // Rank r copies chunk r of the root's tensor into every other rank's tensor.
  bool broadcast(GroupChannel& ch, const at::Tensor& t, int root, DeviceContext& ctx) override {
    c10::cuda::CUDAGuard guard(t.device());
    Mapped m;
    if (!map(ch, {t}, true, ctx, m)) return false;
    const int n = ch.size();
    const size_t bytes = t.numel() * t.element_size();
    auto [lo, hi] = chunkOf(bytes, 1, n, ch.rank());
    kernels::MultiReduceArgs a = copy(hi - lo);
    a.inputs[0] = m.ptr[root][0] + lo;
    for (int p = 0; p < n; ++p) {
      if (p != root) a.outputs[a.numOutputs++] = m.ptr[p][0] + lo;
    }
    run(ch, m, a, {t}, ctx);
    return true;
  }

 private:
  // A byte copy (one input, any dtype): a one-input reduction of bytes.
  static kernels::MultiReduceArgs copy(size_t bytes) {
    kernels::MultiReduceArgs a;
    a.dtype = DType::UInt8;
    a.kind = ReduceKind::BitOr;
    a.numInputs = 1;
    a.count = bytes;
    return a;
  }

  // Exchanges every rank's handles for `ts` (the same roles on every rank) and maps them.
  // False, with nothing enqueued, when any rank cannot take the path; all ranks agree.
  bool map(GroupChannel& ch, const std::vector<at::Tensor>& ts, bool localOk,
           DeviceContext& ctx, Mapped& m) {
    const int n = ch.size();
    const int me = ch.rank();
    const int nt = static_cast<int>(ts.size());
    // Host-synchronised mode: the inputs are ready before this rank's advert leaves, so
    // once every advert has arrived every input is ready and no arrive flags are needed.
    // `auto` takes it when the last exchange showed ranks sharing a GPU: their contexts
    // are time-sliced, and a stream that waits on a peer's flag can hold the GPU for a
    // whole scheduler slice (milliseconds) while the peer's work waits. Every rank saw
    // the same adverts, so every rank makes the same choice.
    m.hostSync = sync_ == Sync::Host || (sync_ == Sync::Auto && sharedGpu_);
    if (m.hostSync) ctx.syncReady();

    Advert mine;
    mine.hostId = thisHostId();
    bool ok = localOk && enabled_ && n <= kernels::kMaxMultiBuffers;
    for (const auto& t : ts) ok = ok && t.is_cuda() && t.is_contiguous() && t.numel() > 0;
    if (ok) {
      try {
        for (int i = 0; i < nt; ++i) {
          // The allocator knows blocks by their start, which is the storage's pointer, not
          // a view's (an in-place all_gather's input is a slice of its output).
          size_t baseSize = 0;
          void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(
              ts[i].storage().data_ptr().get(), &baseSize);
          mine.buffer[i] = peer::exportHandle(base);
          mine.offset[i] = static_cast<uint64_t>(static_cast<char*>(ts[i].data_ptr()) -
                                                 static_cast<char*>(base));
          mine.bytes[i] = ts[i].numel() * ts[i].element_size();
        }
        ensureSignals(ts[0].device().index());
        // Made here, where a failure only takes this op off the path: after the ranks
        // agree, peers would wait on flags this rank never writes (and the watchdog
        // must not fail to make its stream later).
        backendStream(ts[0].device().index());
        sideStream(ts[0].device().index());
        mine.signals = signalsHandle_;
        const std::string& bus = busId(ts[0].device().index());
        std::strncpy(mine.busId, bus.c_str(), sizeof(mine.busId) - 1);
      } catch (const std::exception& e) {
        // Expandable segments, memory not from the caching allocator, no IPC support:
        // this op stages through the host instead.
        TDX_LOG(Detail, prefix_) << "peer-memory path unavailable: " << e.what();
        ok = false;
      }
    }
    mine.eligible = ok ? 1 : 0;

    std::vector<Advert> all(n);
    all[me] = mine;
    exchange(ch, all.data(), sizeof(Advert));
    sharedGpu_ = false;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        sharedGpu_ = sharedGpu_ || (all[p].busId[0] != '\0' &&
                                    std::strncmp(all[p].busId, all[q].busId,
                                                 sizeof(all[p].busId)) == 0);
      }
    }

    // `fresh` must come out the same on every rank, since it decides whether a second
    // exchange follows: it asks whether ANY rank's handle (this rank's included) is new
    // to the group, from `seen_`, which every rank updates identically.
    bool use = true;
    bool fresh = false;
    for (int p = 0; p < n; ++p) {
      use = use && all[p].eligible && all[p].hostId == mine.hostId;
      fresh = fresh || !seen_.count(handleKey(p, all[p].signals));
      for (int i = 0; i < nt; ++i) {
        use = use && all[p].bytes[i] == mine.bytes[i];
        fresh = fresh || !seen_.count(handleKey(p, all[p].buffer[i]));
      }
    }
    if (!use) return false;

    // Map every peer's tensors and signal page. A handle seen before is a cache hit; for
    // a new one, every rank reports whether it could map it, so all ranks agree.
    m.ptr.assign(n, {});
    m.signals.assign(n, nullptr);
    uint8_t mapped = 1;
    try {
      for (int p = 0; p < n; ++p) {
        if (p == me) {
          for (int i = 0; i < nt; ++i) m.ptr[p][i] = static_cast<char*>(ts[i].data_ptr());
          m.signals[p] = signals_;
          continue;
        }
        if (fresh && !peer::canAccessDevice(all[p].busId)) {
          mapped = 0;
          break;
        }
        for (int i = 0; i < nt; ++i) {
          m.ptr[p][i] = static_cast<char*>(maps_.open(all[p].buffer[i])) + all[p].offset[i];
        }
        m.signals[p] = static_cast<uint64_t*>(maps_.open(all[p].signals));
      }
    } catch (const std::exception& e) {
      TDX_LOG(Warn, prefix_) << "could not map a peer's CUDA memory (" << e.what()
                             << "); CUDA collectives of this group stage through the host";
      mapped = 0;
    }
    if (!fresh && !mapped) {
      // Cannot happen (every handle here was mapped before); failing the op is better than
      // leaving the peers waiting on flags this rank will never write.
      throw std::runtime_error("a peer mapping that was valid before could not be reopened");
    }
    if (fresh) {
      std::vector<uint8_t> oks(n);
      oks[me] = mapped;
      exchange(ch, oks.data(), 1);
      for (int p = 0; p < n; ++p) mapped = mapped && oks[p];
      if (!mapped) {
        enabled_ = false;  // every rank saw the same answers: all turn the path off
        return false;
      }
      for (int p = 0; p < n; ++p) {
        seen_.insert(handleKey(p, all[p].signals));
        for (int i = 0; i < nt; ++i) seen_.insert(handleKey(p, all[p].buffer[i]));
      }
    }
    m.stream = backendStream(ts[0].device().index());
    m.seq = ++seq_;
    return true;
  }

  // Enqueues arrive barrier, kernel and done barrier on the backend stream, and hands the
  // end event to the work.
  void run(GroupChannel& ch, Mapped& m, const kernels::MultiReduceArgs& args,
           const std::vector<at::Tensor>& ts, DeviceContext& ctx) {
    const int n = ch.size();
    const int me = ch.rank();
    c10::cuda::CUDAStream stream = *m.stream;
    void* s = stream.stream();
    const std::string what = ts.empty() ? std::string() : describeOp(ts[0]);
    ctx.ready->block(stream);
    try {
      if (!m.hostSync) {
        for (int p = 0; p < n; ++p) {
          if (p != me) peer::streamWriteValue(s, m.signals[p] + kArrive * kSlots + me, m.seq);
        }
        for (int p = 0; p < n; ++p) {
          if (p != me) peer::streamWaitValue(s, signals_ + kArrive * kSlots + p, m.seq);
        }
      }
      kernels::cudaMultiReduce(args, s);
      // Recorded now, before anything below can throw: the kernel is queued, and even an
      // op that fails from here on must keep its tensors' memory from being reused.
      for (const auto& t : ts) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
      }
      if (m.hostSync) {
        // Done barrier on the host: this rank's reads and writes are finished before it
        // says so.
        syncUntil(stream.stream(), std::chrono::steady_clock::now() + timeout_(),
                  "CUDA peer-memory op " + what);
        uint8_t doneFlags[kernels::kMaxMultiBuffers] = {};
        exchange(ch, doneFlags, 1);
      } else {
        for (int p = 0; p < n; ++p) {
          if (p != me) peer::streamWriteValue(s, m.signals[p] + kDone * kSlots + me, m.seq);
        }
        for (int p = 0; p < n; ++p) {
          if (p != me) peer::streamWaitValue(s, signals_ + kDone * kSlots + p, m.seq);
        }
      }
    } catch (...) {
      // Part of the op is queued: the watchdog and shutdown must know of it, or the
      // stream could be blocked (or peers unmapped under it) with nobody watching.
      try {
        auto end = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
        end->record(stream);
        pending_.push_back(Pending{end, m.seq, n, stream.device_index(),
                                   std::chrono::steady_clock::now() + timeout_(), what,
                                   weakly(ts)});
      } catch (...) {  // the op's own error says more than this one
      }
      throw;
    }
    ctx.done = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    ctx.done->record(stream);
    ctx.stream = stream;
    if (!m.hostSync) {
      // Only GPU-side waits can outlive a dead peer; host-synchronised ops finished above.
      pending_.push_back(Pending{ctx.done, m.seq, n, stream.device_index(),
                                 std::chrono::steady_clock::now() + timeout_(), what,
                                 weakly(ts)});
    }
    ++opsRun_;
  }

  // Keeps the stuck op's and every later op's live tensors for good (quarantine), then
  // releases them all (raiseFlags). The watchdog is off from here on: no later pass would
  // look. Requires hasPending().
  std::string releasePending() {
    const std::deque<Pending> released = std::move(pending_);
    pending_.clear();
    enabled_ = false;
    // Kept before the stream moves on: a tensor the caller frees after the release could
    // otherwise go back to the allocator once the stream passes it.
    try {
      quarantine(released);
    } catch (...) {  // out of memory: the release matters more
    }
    return raiseFlags(released, signals_, sideStream(released.front().device).stream(), rank_);
  }

  // Waits a little for this rank's device work to end: an op issued just before the
  // group was destroyed, not waited for. Stuck work is not waited for (the destructor
  // may run with the GIL held), nor released: a peer that is only slow would find this
  // rank's kernel run before its own arrival, and would write its share into tensors
  // this rank may have freed since. False when some work, tracked or not, still runs.
  bool drain() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    auto idle = [&] {
      if (hasPending()) return false;
      for (const auto& [device, st] : streams_) {
        const cudaError_t e = cudaStreamQuery(st);
        if (e == cudaErrorNotReady) return false;
        if (e != cudaSuccess) cudaGetLastError();  // an error is not work still running
      }
      return true;
    };
    while (!idle()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  void ensureSignals(c10::DeviceIndex device) {
    if (signals_) return;
    const size_t bytes = kPhases * kSlots * sizeof(uint64_t);
    void* p = nullptr;
    // cudaMalloc directly (not the caching allocator): the page lives as long as the
    // group and its IPC handle must stay the same for every op. Zeroed on a stream of
    // our own and waited for alone: a device-wide synchronize would also wait for any
    // stuck work of other groups.
    const cudaStream_t s = sideStream(device).stream();  // first: it may throw
    bool ok = cudaMalloc(&p, bytes) == cudaSuccess;
    if (ok) {
      ok = cudaMemsetAsync(p, 0, bytes, s) == cudaSuccess &&
           cudaStreamSynchronize(s) == cudaSuccess;
    }
    if (!ok) {
      cudaGetLastError();
      if (p) cudaFree(p);
      throw std::runtime_error("could not allocate the peer-memory signal page");
    }
    signals_ = static_cast<uint64_t*>(p);
    signalsHandle_ = peer::exportHandle(p);
  }

  // The PCI bus id of `device`, asked of the driver once per device, not once per op.
  const std::string& busId(c10::DeviceIndex device) {
    auto it = busIds_.find(device);
    if (it == busIds_.end()) it = busIds_.emplace(device, peer::currentDeviceBusId()).first;
    return it->second;
  }

  c10::cuda::CUDAStream backendStream(c10::DeviceIndex device) {
    auto it = streams_.find(device);
    if (it == streams_.end()) {
      it = streams_.emplace(device, StreamPool::instance().take(device, true)).first;
    }
    return c10::cuda::getStreamFromExternal(it->second, device);
  }

  // For the watchdog and the signal page: never the backend stream, which may be stuck.
  c10::cuda::CUDAStream sideStream(c10::DeviceIndex device) {
    auto it = sideStreams_.find(device);
    if (it == sideStreams_.end()) {
      it = sideStreams_.emplace(device, StreamPool::instance().take(device, false)).first;
    }
    return c10::cuda::getStreamFromExternal(it->second, device);
  }

  // Allgather of `bytes` per rank over the group's host channel; data[rank] is ours.
  // The transfers land in the channel's scratch, and only a finished exchange is copied
  // into `data`: `data` lives in a caller's frame, which an error unwinds, while a receive
  // that UCX cannot cancel may still write its buffer afterwards. The scratch is
  // abandoned, not freed, when that can happen (GroupChannel::quiesce).
  static void exchange(GroupChannel& ch, void* data, size_t bytes) {
    const int n = ch.size();
    const size_t mine = static_cast<size_t>(ch.rank()) * bytes;
    char* buf = ch.scratch(n * bytes);
    std::memcpy(buf + mine, static_cast<const char*>(data) + mine, bytes);
    std::vector<algorithms::Block> blocks(n);
    for (int p = 0; p < n; ++p) blocks[p] = algorithms::Block{buf + p * bytes, bytes};
    algorithms::ringAllgather(ch, blocks);
    std::memcpy(data, buf, n * bytes);
  }

  static std::string describeOp(const at::Tensor& t) {
    std::ostringstream os;
    os << "on " << c10::toString(t.scalar_type()) << t.sizes() << " " << t.device();
    return os.str();
  }

  int rank_;
  int size_;
  std::string prefix_;
  Sync sync_;               // TDX_CUDA_PEER_SYNC
  std::function<std::chrono::milliseconds()> timeout_;
  std::deque<Pending> pending_;  // GPU-flag ops whose end event has not been seen yet
  bool sharedGpu_ = false;  // the last exchange showed two ranks on one GPU
  bool enabled_ = true;
  uint64_t seq_ = 0;
  uint64_t opsRun_ = 0;
  uint64_t* signals_ = nullptr;
  peer::IpcHandle signalsHandle_{};
  peer::IpcMapCache maps_;
  std::set<std::string> seen_;
  std::map<c10::DeviceIndex, cudaStream_t> streams_;      // backend, per device (StreamPool)
  std::map<c10::DeviceIndex, cudaStream_t> sideStreams_;  // watchdog, set-up (StreamPool)
  std::map<c10::DeviceIndex, std::string> busIds_;
  std::string deviceError_;  // a CUDA error seen while watching pending ops
  bool deviceErrorTold_ = false;
};

} // namespace

std::unique_ptr<PeerMemory> PeerMemory::create(
    int rank, int size, std::string prefix, std::function<std::chrono::milliseconds()> timeout) {
  if (env::getInt("TDX_CUDA_PEER") == 0) return nullptr;
  const std::string sync = env::get("TDX_CUDA_PEER_SYNC");
  if (sync != "auto" && sync != "gpu" && sync != "host") {
    throw std::invalid_argument(prefix + ": TDX_CUDA_PEER_SYNC must be auto, gpu or host, got '" +
                                sync + "'");
  }
  using Sync = CudaPeerMemory::Sync;
  return std::make_unique<CudaPeerMemory>(
      rank, size, std::move(prefix),
      sync == "gpu" ? Sync::Gpu : (sync == "host" ? Sync::Host : Sync::Auto), std::move(timeout));
}

#else

std::unique_ptr<PeerMemory> PeerMemory::create(int, int, std::string,
                                               std::function<std::chrono::milliseconds()>) {
  return nullptr;
}

#endif

} // namespace tdx
