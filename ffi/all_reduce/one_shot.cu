// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// One-shot all-reduce within one group of PEs (NVRAR, arXiv 2511.09557, sec. 3:
// the intra-node one-shot peer; PyTorch symmetric memory's one_shot_all_reduce
// is the same idea). Every rank pushes its whole input into a slot of every
// peer with one put-with-signal per block, waits for the signals of all peers,
// then sums all contributions in rank order in fp32, so every rank computes
// bit-identical results.
//
// Completion and reuse: each ordered pair of PEs keeps a call counter (the
// epoch) in device memory on both sides; the sender signals epoch e into the
// receiver's flag for (parity e%2, sender, block). A sender can only start call
// e+2 after finishing call e+1, which needed the receiver's e+1 data, which the
// receiver sent only after its call-e kernel (the one reading parity e%2)
// ended. So two parities suffice, with no acknowledgement message and no reset.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <string>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/check.h"
#include "jaxoverlap/device_utils.cuh"
#include "jaxoverlap/runtime.h"

namespace jaxoverlap::all_reduce {

namespace {

constexpr int kThreads = 512;
constexpr size_t kMinBytesPerBlock = 16 * 1024;

struct OneShotParams {
  const void* in;
  void* out;
  size_t num_elements;
  size_t elements_per_block;  // multiple of 16 bytes' worth of elements
  Group group;
  int my_pe;
  int num_pes;
  char* data;          // symmetric slots [parity][sender pe][slot_bytes]
  uint64_t* signals;   // symmetric flags [parity][sender pe][block]
  size_t slot_bytes;
  uint64_t* pair_epochs;      // device [num_pes]
  unsigned int* done_counter;  // device
  DeviceError* error;
  uint64_t timeout_ns;
};

__device__ __forceinline__ char* Slot(const OneShotParams& p, int parity, int sender_pe) {
  return p.data + (static_cast<size_t>(parity) * p.num_pes + sender_pe) * p.slot_bytes;
}

__device__ __forceinline__ uint64_t* Flag(const OneShotParams& p, int parity, int sender_pe,
                                          int block) {
  return p.signals + (static_cast<size_t>(parity) * p.num_pes + sender_pe) * kMaxBlocks + block;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotKernel(OneShotParams p) {
  const Group& g = p.group;
  const size_t begin = min(p.num_elements, blockIdx.x * p.elements_per_block);
  const size_t end = min(p.num_elements, begin + p.elements_per_block);
  const size_t bytes = (end - begin) * sizeof(T);
  const T* in = static_cast<const T*>(p.in);

  // 1. Push this block's range to every peer, starting with the next rank so
  //    that not every rank writes into the same peer at once.
  for (int i = 1; i < g.num_ranks; ++i) {
    const int r = (g.rank + i) % g.num_ranks;
    const int pe = g.pes[r];
    const uint64_t epoch = p.pair_epochs[pe] + 1;
    const int parity = static_cast<int>(epoch & 1);
    uint64_t* flag = Flag(p, parity, p.my_pe, blockIdx.x);
    if (bytes > 0) {
      char* dst = Slot(p, parity, p.my_pe) + begin * sizeof(T);
      nvshmemx_putmem_signal_nbi_block(dst, in + begin, bytes, flag, epoch, NVSHMEM_SIGNAL_SET,
                                       pe);
    } else if (threadIdx.x == 0) {
      nvshmemx_signal_op(flag, epoch, NVSHMEM_SIGNAL_SET, pe);
    }
  }

  // 2. Wait for every peer's range (one waiting thread per peer).
  if (threadIdx.x < g.num_ranks && threadIdx.x != g.rank) {
    const int pe = g.pes[threadIdx.x];
    const uint64_t epoch = p.pair_epochs[pe] + 1;
    WaitFlagOrTrap(Flag(p, static_cast<int>(epoch & 1), pe, blockIdx.x), epoch, p.timeout_ns,
                   p.error, g.rank, pe, /*step=*/0);
  }
  __syncthreads();

  // 3. Reduce in rank order with fp32 accumulation.
  const T* src[kMaxGroupSize];
  for (int r = 0; r < g.num_ranks; ++r) {
    if (r == g.rank) {
      src[r] = in;
    } else {
      const int pe = g.pes[r];
      const int parity = static_cast<int>((p.pair_epochs[pe] + 1) & 1);
      src[r] = reinterpret_cast<const T*>(Slot(p, parity, pe));
    }
  }
  T* out = static_cast<T*>(p.out);
  for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float acc = ToFloat(src[0][i]);
    for (int r = 1; r < g.num_ranks; ++r) acc += ToFloat(src[r][i]);
    out[i] = FromFloat<T>(acc);
  }

  // 4. Sends complete before the input buffer goes back to XLA; the last
  //    block to finish advances the epochs for the next call.
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    __threadfence();
    const unsigned int finished = atomicAdd(p.done_counter, 1u);
    if (finished == gridDim.x - 1) {
      for (int r = 0; r < g.num_ranks; ++r) {
        if (r != g.rank) p.pair_epochs[g.pes[r]] += 1;
      }
      *p.done_counter = 0;
      __threadfence();
    }
  }
}

size_t ElementBytes(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32:
      return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
      return 2;
    default:
      return 0;
  }
}

// Launch configuration: one block per 16 KiB, at most kMaxBlocks. It depends
// only on the message size, so every rank of a group picks the same grid.
int OneShotNumBlocks(size_t bytes) {
  const size_t blocks = (bytes + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

}  // namespace

ffi::Error OneShot(cudaStream_t stream, ffi::DataType dtype, const void* in, void* out,
                   size_t num_elements, const Group& group) {
  const RuntimeState& s = State();
  if (!s.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxoverlap.initialize() has not been called in this process");
  }
  const size_t elem = ElementBytes(dtype);
  if (elem == 0) {
    return ffi::Error::InvalidArgument("all_reduce: dtype must be float32, bfloat16 or float16");
  }
  const size_t bytes = num_elements * elem;
  if (bytes > s.slot_bytes) {
    return ffi::Error::InvalidArgument(
        "all_reduce one_shot: message of " + std::to_string(bytes) +
        " bytes exceeds the one-shot slot of " + std::to_string(s.slot_bytes) +
        " bytes of the symmetric heap");
  }
  if (num_elements == 0) return ffi::Error::Success();

  OneShotParams p;
  p.in = in;
  p.out = out;
  p.num_elements = num_elements;
  const int blocks = OneShotNumBlocks(bytes);
  const size_t per16 = 16 / elem;
  size_t per_block = (num_elements + blocks - 1) / blocks;
  p.elements_per_block = (per_block + per16 - 1) / per16 * per16;
  p.group = group;
  p.my_pe = s.my_pe;
  p.num_pes = s.num_pes;
  p.data = s.data;
  p.signals = s.signals;
  p.slot_bytes = s.slot_bytes;
  p.pair_epochs = s.pair_epochs;
  p.done_counter = s.done_counter;
  p.error = s.error_device;
  p.timeout_ns = s.timeout_ns;

  switch (dtype) {
    case ffi::DataType::F32:
      OneShotKernel<float><<<blocks, kThreads, 0, stream>>>(p);
      break;
    case ffi::DataType::BF16:
      OneShotKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
      break;
    default:
      OneShotKernel<__half><<<blocks, kThreads, 0, stream>>>(p);
      break;
  }
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("OneShotKernel launch");
  return ffi::Error::Success();
}

}  // namespace jaxoverlap::all_reduce
