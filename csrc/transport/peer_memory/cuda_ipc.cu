// CUDA IPC windows and stream-ordered flags; see cuda_ipc.h.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "transport/peer_memory/cuda_ipc.h"

namespace tdx {
namespace transport {
namespace peer {
namespace {

static_assert(sizeof(IpcHandle) == sizeof(cudaIpcMemHandle_t), "IPC handle size");

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

// The driver's stream memory operations, found through the runtime so the extension does
// not link libcuda (it must import on machines without a driver).
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

struct MemOps {
  StreamValueFn write = nullptr;
  StreamValueFn wait = nullptr;
  std::atomic<bool> usable{false};

  MemOps() {
    void* w = nullptr;
    void* v = nullptr;
    cudaDriverEntryPointQueryResult qw{}, qv{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &w, 12000, cudaEnableDefault,
                                         &qw) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &v, 12000, cudaEnableDefault,
                                         &qv) == cudaSuccess &&
        qw == cudaDriverEntryPointSuccess && qv == cudaDriverEntryPointSuccess && w && v) {
      write = reinterpret_cast<StreamValueFn>(w);
      wait = reinterpret_cast<StreamValueFn>(v);
      usable = true;
    }
    cudaGetLastError();
  }
};

MemOps& memOps() {
  static MemOps ops;
  return ops;
}

// Fallbacks for devices without stream memory operations. The wait kernel occupies one
// thread of one SM while it polls; __nanosleep keeps it from hammering the memory system.
__global__ void writeFlagKernel(volatile uint64_t* addr, uint64_t value) {
  __threadfence_system();
  *addr = value;
  __threadfence_system();
}

__global__ void waitFlagKernel(volatile const uint64_t* addr, uint64_t value) {
  while (*addr < value) __nanosleep(200);
  __threadfence_system();
}

} // namespace

IpcHandle exportHandle(void* base) {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle");
  IpcHandle out;
  std::memcpy(out.bytes, &h, sizeof(h));
  return out;
}

IpcMapCache::~IpcMapCache() {
  for (auto& kv : mapped_) cudaIpcCloseMemHandle(kv.second);
  cudaGetLastError();
}

void* IpcMapCache::open(const IpcHandle& handle) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::string key(handle.bytes, sizeof(handle.bytes));
  key.append(reinterpret_cast<const char*>(&dev), sizeof(dev));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mapped_.find(key);
  if (it != mapped_.end()) return it->second;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.bytes, sizeof(h));
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  mapped_.emplace(std::move(key), ptr);
  return ptr;
}

size_t IpcMapCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_.size();
}

void IpcMapCache::abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  mapped_.clear();
}

bool streamMemOpsAvailable() {
  return memOps().usable.load();
}

void streamWriteValue(void* stream, uint64_t* addr, uint64_t value) {
  auto& ops = memOps();
  auto s = static_cast<cudaStream_t>(stream);
  if (ops.usable.load() &&
      ops.write(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), value,
                CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS) {
    return;
  }
  ops.usable = false;  // not supported here: every later call takes the kernel path
  writeFlagKernel<<<1, 1, 0, s>>>(addr, value);
  check(cudaGetLastError(), "flag write kernel launch");
}

void streamWaitValue(void* stream, const uint64_t* addr, uint64_t value) {
  auto& ops = memOps();
  auto s = static_cast<cudaStream_t>(stream);
  if (ops.usable.load() &&
      ops.wait(reinterpret_cast<CUstream>(s),
               reinterpret_cast<CUdeviceptr>(const_cast<uint64_t*>(addr)), value,
               CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS) {
    return;
  }
  ops.usable = false;
  waitFlagKernel<<<1, 1, 0, s>>>(addr, value);
  check(cudaGetLastError(), "flag wait kernel launch");
}

std::string currentDeviceBusId() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  char buf[32] = {};
  check(cudaDeviceGetPCIBusId(buf, sizeof(buf), dev), "cudaDeviceGetPCIBusId");
  return buf;
}

bool canAccessDevice(const std::string& busId) {
  int dev = 0;
  int other = -1;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetByPCIBusId(&other, busId.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return false;  // not visible to this process (e.g. CUDA_VISIBLE_DEVICES)
  }
  if (other == dev) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, dev, other) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

} // namespace peer
} // namespace transport
} // namespace tdx
