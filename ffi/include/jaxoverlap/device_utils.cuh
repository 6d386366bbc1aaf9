// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// Device helpers shared by the kernels: type conversion for fp32 accumulation,
// acquire loads of completion flags, and bounded waits that report who did
// not arrive instead of spinning forever.
#ifndef JAXOVERLAP_DEVICE_UTILS_CUH_
#define JAXOVERLAP_DEVICE_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

#include "jaxoverlap/runtime.h"

namespace jaxoverlap {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

// Fills the record unless another report claimed it first, then publishes its code. A
// thread that lost the claim waits (up to a millisecond) for the winner's code before it
// traps: its trap would end the kernel, and with it the winner's stores.
static __device__ __noinline__ void PublishDeviceError(DeviceError* error, int32_t code, OpId op,
                                                       int rank, int peer_pe, int step,
                                                       int block, uint64_t epoch, uint64_t seen,
                                                       WaitKind wait) {
  if (atomicCAS(&error->claim, 0, 1) == 0) {
    error->op = static_cast<int32_t>(op);
    error->rank = rank;
    error->peer_pe = peer_pe;
    error->step = step;
    error->block = block;
    error->epoch = epoch;
    error->seen = seen;
    error->wait = static_cast<int32_t>(wait);
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&error->code) = code;
    __threadfence_system();
    return;
  }
  const uint64_t start = GlobalTimerNs();
  while (*reinterpret_cast<volatile int32_t*>(&error->code) == 0 &&
         GlobalTimerNs() - start < 1000000) {
  }
}

// Records who did not arrive in `error` (the first timeout wins), prints it
// and traps: a hang becomes an error that names rank, peer and step. `block`
// (default: the waiting block) names the block, range or chunk waited for.
static __device__ __noinline__ void ReportTimeoutAndTrap(DeviceError* error, OpId op, int rank,
                                                         int peer_pe, int step, uint64_t expected,
                                                         uint64_t seen, int block = -1,
                                                         WaitKind wait = WaitKind::kSignal) {
  if (block < 0) block = static_cast<int>(blockIdx.x);
  PublishDeviceError(error, 1, op, rank, peer_pe, step, block, expected, seen, wait);
  printf("jaxoverlap: device wait timed out: rank %d waited for peer PE %d at step %d "
         "(block %d, epoch %llu, seen %llu)\n",
         rank, peer_pe, step, block,
         static_cast<unsigned long long>(expected), static_cast<unsigned long long>(seen));
  __trap();
}

// Records that the calls with `peer_pe` reached `epoch`, the end of a period
// of the LL protocol's 32-bit flags, in a kernel that advanced its epochs at
// its start (the measurement knob JAXOVERLAP_EPOCH_AT_START=1), which cannot
// re-stamp the cells there (all_reduce.cu, "period end"); prints it and traps:
// the run stops instead of reading a stale line. Code 2 in `error`.
static __device__ __noinline__ void ReportEpochWrapAndTrap(DeviceError* error, OpId op, int rank,
                                                           int peer_pe, uint64_t epoch) {
  PublishDeviceError(error, 2, op, rank, peer_pe, /*step=*/0, static_cast<int>(blockIdx.x),
                     epoch, /*seen=*/0, WaitKind::kSignal);
  printf("jaxoverlap: rank %d reached call %llu with peer PE %d, the end of a period of the "
         "32-bit LL flags, which JAXOVERLAP_EPOCH_AT_START=1 cannot cross; stopping\n",
         rank, static_cast<unsigned long long>(epoch), peer_pe);
  __trap();
}

// Called by thread 0 of each block once the block's work is done: takes the
// block's ticket from `done_counter`; true for the last block of the grid, the
// one that may advance the call's epochs and reset the counter (the
// all-reduce's Finish; ffi/launch_floor.cu times the same bookkeeping).
__device__ __forceinline__ bool TookLastTicket(unsigned int* done_counter) {
  return atomicAdd(done_counter, 1u) == gridDim.x - 1;
}

// Waits until *flag >= expected, or reports and traps after timeout_ns.
__device__ __forceinline__ void WaitFlagOrTrap(const uint64_t* flag, uint64_t expected,
                                               uint64_t timeout_ns, DeviceError* error, OpId op,
                                               int rank, int peer_pe, int step, int block = -1) {
  if (LoadAcquireSys(flag) >= expected) return;
  const uint64_t start = GlobalTimerNs();
  uint64_t seen;
  while ((seen = LoadAcquireSys(flag)) < expected) {
    if (GlobalTimerNs() - start > timeout_ns) {
      ReportTimeoutAndTrap(error, op, rank, peer_pe, step, expected, seen, block);
    }
  }
}

}  // namespace jaxoverlap

#endif  // JAXOVERLAP_DEVICE_UTILS_CUH_
