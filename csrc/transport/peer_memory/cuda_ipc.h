// Same-host device memory windows: CUDA IPC handles and GPU-side signalling.
//
// A rank exports the allocation that holds a buffer as a 64-byte handle; a peer process
// on the same host opens it once and keeps the mapping (IpcMapCache), so repeated
// collectives on the same allocation cost no driver call. Ranks synchronise through
// 64-bit flags in each other's device memory, written and awaited by the GPU's stream
// front end (cuStreamWriteValue64 / cuStreamWaitValue64), so no host barrier and no
// spinning kernel sits between ranks, which matters when several ranks share one GPU
// and their contexts are time-sliced.
//
// Knows nothing of torch or collectives. Built only when CUDA is (TDX_WITH_CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace tdx {
namespace transport {
namespace peer {

// cudaIpcMemHandle_t's bytes (CUDA_IPC_HANDLE_SIZE), kept opaque here.
struct IpcHandle {
  char bytes[64];
};

// The handle of the allocation that starts at `base` (a cudaMalloc'd block). Throws
// std::runtime_error naming the CUDA error.
IpcHandle exportHandle(void* base);

// Mappings of peers' allocations into this process, one per distinct handle, kept until
// the cache is destroyed. Thread-safe.
class IpcMapCache {
 public:
  IpcMapCache() = default;
  ~IpcMapCache();
  IpcMapCache(const IpcMapCache&) = delete;
  IpcMapCache& operator=(const IpcMapCache&) = delete;

  // The local address of the peer allocation behind `handle`, opened on the current
  // device on first use.
  void* open(const IpcHandle& handle);
  size_t size() const;
  // Forgets every mapping without closing it: for an owner whose device work may still
  // use them (closing would fault that work). They stay mapped until the process exits.
  void abandon();

 private:
  mutable std::mutex mu_;
  std::map<std::string, void*> mapped_;
};

// GPU-side signalling on a stream (passed as void*: a cudaStream_t).
// writeValue: *addr = value once the stream's earlier work is done (with a memory
// barrier, so writes of earlier kernels are visible first).
// waitValue: later work on the stream waits until *addr >= value (64-bit, unsigned).
// Both use the driver's stream memory operations when the device supports them and a
// one-thread kernel otherwise.
void streamWriteValue(void* stream, uint64_t* addr, uint64_t value);
void streamWaitValue(void* stream, const uint64_t* addr, uint64_t value);

// True when the driver's stream memory operations are in use (for logs and benchmarks).
bool streamMemOpsAvailable();

// "pci bus id" of the current device, e.g. "0000:19:00.0": tells peers whether two ranks
// share a GPU.
std::string currentDeviceBusId();

// True when the current device can read and write memory of the device with `busId`
// (the same device, or peer access over NVLink/PCIe).
bool canAccessDevice(const std::string& busId);

} // namespace peer
} // namespace transport
} // namespace tdx
