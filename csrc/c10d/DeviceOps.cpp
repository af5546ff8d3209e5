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
#include <cstring>
#include <fstream>
#include <set>
#include <unistd.h>

#include "algorithms/collectives.h"
#include "common/env.h"
#include "common/logging.h"

#ifdef TDX_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
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
struct Advert {
  uint8_t eligible = 0;
  uint8_t pad[7] = {};
  uint64_t hostId = 0;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // the tensor's start within its allocation
  char busId[32] = {};
  peer::IpcHandle signals{};
  peer::IpcHandle buffer{};
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

class CudaPeerMemory final : public PeerMemory {
 public:
  CudaPeerMemory(int rank, int size, std::string prefix)
      : rank_(rank), size_(size), prefix_(std::move(prefix)) {}

  ~CudaPeerMemory() override {
    // Peers may still hold our signal page open; freeing is safe (their mappings keep
    // the memory alive until they close them).
    if (signals_) cudaFree(signals_);
    cudaGetLastError();
  }

  uint64_t opsRun() const override {
    return opsRun_;
  }

  bool allreduce(GroupChannel& ch, const at::Tensor& t, const Reduction& red,
                 DeviceContext& ctx) override {
    const int n = ch.size();
    const int me = ch.rank();
    c10::cuda::CUDAGuard guard(t.device());

    Advert mine;
    mine.hostId = thisHostId();
    void* base = nullptr;
    bool ok = enabled_ && n <= kernels::kMaxMultiBuffers && t.is_cuda() && t.is_contiguous() &&
              t.numel() > 0 && kernels::cudaReduceSupported(red.dtype, red.kind);
    if (ok) {
      try {
        size_t baseSize = 0;
        base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.data_ptr(), &baseSize);
        mine.buffer = peer::exportHandle(base);
        mine.offset = static_cast<uint64_t>(static_cast<char*>(t.data_ptr()) -
                                            static_cast<char*>(base));
        ensureSignals();
        mine.signals = signalsHandle_;
        const std::string bus = peer::currentDeviceBusId();
        std::strncpy(mine.busId, bus.c_str(), sizeof(mine.busId) - 1);
        mine.bytes = t.numel() * t.element_size();
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

    // `fresh` must come out the same on every rank, since it decides whether a second
    // exchange follows: it asks whether ANY rank's handle (this rank's included) is new
    // to the group, from `seen_`, which every rank updates identically.
    bool use = true;
    bool fresh = false;
    for (int p = 0; p < n; ++p) {
      use = use && all[p].eligible && all[p].hostId == mine.hostId && all[p].bytes == mine.bytes;
      fresh = fresh || !seen_.count(handleKey(p, all[p].buffer)) ||
              !seen_.count(handleKey(p, all[p].signals));
    }
    if (!use) return false;

    // Map every peer's tensor and signal page. A handle seen before is a cache hit; for a
    // new one, every rank reports whether it could map it, so all ranks agree.
    std::vector<char*> buffers(n);
    std::vector<uint64_t*> signals(n);
    uint8_t mapped = 1;
    try {
      for (int p = 0; p < n; ++p) {
        if (p == me) {
          buffers[p] = static_cast<char*>(t.data_ptr());
          signals[p] = signals_;
          continue;
        }
        if (fresh && !peer::canAccessDevice(all[p].busId)) {
          mapped = 0;
          break;
        }
        buffers[p] = static_cast<char*>(maps_.open(all[p].buffer)) + all[p].offset;
        signals[p] = static_cast<uint64_t*>(maps_.open(all[p].signals));
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
        seen_.insert(handleKey(p, all[p].buffer));
        seen_.insert(handleKey(p, all[p].signals));
      }
    }

    // Device work, all on the backend stream.
    c10::cuda::CUDAStream stream = backendStream(t.device().index());
    void* s = stream.stream();
    ctx.ready->block(stream);
    const uint64_t seq = ++seq_;
    for (int p = 0; p < n; ++p) {
      if (p != me) peer::streamWriteValue(s, signals[p] + kArrive * kSlots + me, seq);
    }
    for (int p = 0; p < n; ++p) {
      if (p != me) peer::streamWaitValue(s, signals_ + kArrive * kSlots + p, seq);
    }

    kernels::MultiReduceArgs args;
    const size_t es = t.element_size();
    const size_t count = t.numel();
    // Chunks of whole 16-byte vectors keep every chunk as aligned as the tensor.
    const size_t align = std::max<size_t>(1, 16 / es);
    const size_t per = (count + n - 1) / n;
    const size_t chunk = (per + align - 1) / align * align;
    const size_t lo = std::min(count, chunk * me);
    const size_t hi = std::min(count, lo + chunk);
    for (int p = 0; p < n; ++p) {
      args.inputs[p] = buffers[p] + lo * es;
      args.outputs[p] = buffers[p] + lo * es;
    }
    args.numInputs = n;
    args.numOutputs = n;
    args.count = hi - lo;
    args.dtype = red.dtype;
    args.kind = red.kind;
    args.premul = red.premul;
    args.premulFactor = red.premul ? red.factor() : 1.0;
    args.divisor = red.average ? n : 1;
    kernels::cudaMultiReduce(args, s);

    for (int p = 0; p < n; ++p) {
      if (p != me) peer::streamWriteValue(s, signals[p] + kDone * kSlots + me, seq);
    }
    for (int p = 0; p < n; ++p) {
      if (p != me) peer::streamWaitValue(s, signals_ + kDone * kSlots + p, seq);
    }

    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    ctx.done = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    ctx.done->record(stream);
    ctx.stream = stream;
    ++opsRun_;
    return true;
  }

 private:
  // Signal page layout: kPhases rows of kSlots 64-bit flags; row `phase`, column `p` is
  // written by rank p. Flags only grow (they hold the op's sequence number).
  static constexpr int kArrive = 0;
  static constexpr int kDone = 1;
  static constexpr int kPhases = 2;
  static constexpr int kSlots = kernels::kMaxMultiBuffers;

  void ensureSignals() {
    if (signals_) return;
    const size_t bytes = kPhases * kSlots * sizeof(uint64_t);
    void* p = nullptr;
    // cudaMalloc directly (not the caching allocator): the page lives as long as the
    // group and its IPC handle must stay the same for every op.
    if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemset(p, 0, bytes) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      cudaGetLastError();
      if (p) cudaFree(p);
      throw std::runtime_error("could not allocate the peer-memory signal page");
    }
    signals_ = static_cast<uint64_t*>(p);
    signalsHandle_ = peer::exportHandle(p);
  }

  c10::cuda::CUDAStream backendStream(c10::DeviceIndex device) {
    if (!stream_ || stream_->device_index() != device) {
      stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    }
    return *stream_;
  }

  // Allgather of `bytes` per rank over the group's host channel; data[rank] is ours.
  static void exchange(GroupChannel& ch, void* data, size_t bytes) {
    std::vector<algorithms::Block> blocks(ch.size());
    for (int p = 0; p < ch.size(); ++p) {
      blocks[p] = algorithms::Block{static_cast<char*>(data) + p * bytes, bytes};
    }
    algorithms::ringAllgather(ch, blocks);
  }

  int rank_;
  int size_;
  std::string prefix_;
  bool enabled_ = true;
  uint64_t seq_ = 0;
  uint64_t opsRun_ = 0;
  uint64_t* signals_ = nullptr;
  peer::IpcHandle signalsHandle_{};
  peer::IpcMapCache maps_;
  std::set<std::string> seen_;
  std::optional<c10::cuda::CUDAStream> stream_;
};

} // namespace

std::unique_ptr<PeerMemory> PeerMemory::create(int rank, int size, std::string prefix) {
  if (env::getInt("TDX_CUDA_PEER") == 0) return nullptr;
  return std::make_unique<CudaPeerMemory>(rank, size, std::move(prefix));
}

#else

std::unique_ptr<PeerMemory> PeerMemory::create(int, int, std::string) {
  return nullptr;
}

#endif

} // namespace tdx
