// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// A benchmark aid: an FFI custom call that copies its input to its output
// with one kernel launch and no communication. Timed in the same chain as the
// all-reduces, it is the floor that any single-kernel custom call pays inside
// XLA (thunk, command-buffer node, launch), so the benchmarks can say how much
// of an all-reduce's latency is communication.
//
// Variants of the same copy, each its own handler (benchmarks/launch_floor_pdl.py
// times them side by side):
//   * "_pdl" launches the kernel with programmatic dependent launch (Hopper;
//     cudaLaunchAttributeProgrammaticStreamSerialization): the kernel may be
//     scheduled while the kernel before it in the stream is still finishing,
//     and waits (griddepcontrol.wait) for that kernel's completion and memory
//     before its first load: what PDL would save the collectives' kernels.
//   * "_bookkeeping" adds parts of the per-call bookkeeping of the all-reduce
//     kernels (ffi/all_reduce/all_reduce.cu) without their communication: every
//     thread reads the call's epoch from device memory before its first store,
//     and each block ends as Finish did until commit 21426c6 (a barrier, thread
//     0 takes a ticket; the last block advances the epoch, resets the counter
//     and fences; Finish no longer fences); or alternatives that need no ticket
//     at the end (kStartCount, kStartTicket). The difference to the plain copy
//     is what that bookkeeping costs a call on one GPU.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jaxoverlap/check.h"
#include "jaxoverlap/device_utils.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace {

enum class FloorMode { kPlain, kPdl, kBookkeeping };

// The bookkeeping variant's state, per GPU (module globals live per device):
// the call's epoch and the blocks' tickets, as RuntimeState's pair_epochs and
// done_counter.
__device__ uint64_t g_floor_epoch;
__device__ unsigned int g_floor_tickets[2];

// The bookkeeping variant's parts (a bitmask; benchmarks/launch_floor_pdl.py
// names the combinations).
constexpr int kEpochRead = 1;   // every thread reads the epoch before its first store
constexpr int kEndTicket = 2;   // Finish: barrier, a ticket per block, the last advances
constexpr int kEndFence = 4;    // ... and fences
constexpr int kStartCount = 8;  // instead: thread 0 reads the epoch, a barrier, then a
                                // release add to a start counter; at the end block 0
                                // waits until every block has started, then advances
constexpr int kStartTicket = 16;  // instead: thread 0 reads the epoch, a barrier, then
                                  // takes a ticket; the last block to take one advances
                                  // the epoch there, at its start: nothing at the end

template <FloorMode kMode>
__global__ void CopyKernel(const uint4* in, uint4* out, size_t num_vectors, const char* in_tail,
                           char* out_tail, size_t tail_bytes, int parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // PDL is Hopper's; a plain launch before it
  if constexpr (kMode == FloorMode::kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // The all-reduce kernels address their slots and flags by the epoch, so no
  // store of theirs issues before it is read: here every vector store waits on
  // it (the tail's few bytes do not).
  uint64_t epoch = 1;
  if constexpr (kMode == FloorMode::kBookkeeping) {
    if (parts & (kStartCount | kStartTicket)) {  // one read per block, then a barrier
      __shared__ uint64_t shared_epoch;
      if (threadIdx.x == 0) {
        shared_epoch = *reinterpret_cast<volatile uint64_t*>(&g_floor_epoch) + 1;
      }
      __syncthreads();
      epoch = shared_epoch;
    }
    if (parts & kStartCount) {
      if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(g_floor_tickets + 1)
                     : "memory");
      }
    } else if (parts & kStartTicket) {
      if (threadIdx.x == 0) {
        uint32_t ticket;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket)
                     : "l"(g_floor_tickets) : "memory");
        if (ticket == gridDim.x - 1) {
          g_floor_epoch = epoch;
          g_floor_tickets[0] = 0;
        }
      }
    } else if (parts & kEpochRead) {
      epoch = *reinterpret_cast<volatile uint64_t*>(&g_floor_epoch) + 1;
    }
  }
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_vectors;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if (epoch != 0) out[i] = in[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < tail_bytes) out_tail[threadIdx.x] = in_tail[threadIdx.x];
  if constexpr (kMode == FloorMode::kBookkeeping) {
    if (parts & kStartCount) {
      if (blockIdx.x == 0 && threadIdx.x == 0) {
        uint32_t started = 0;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(started)
                       : "l"(g_floor_tickets + 1) : "memory");
        } while (started < gridDim.x);
        g_floor_epoch = epoch;
        g_floor_tickets[1] = 0;
      }
    } else if (parts & kEndTicket) {
      __syncthreads();
      if (threadIdx.x == 0 && TookLastTicket(g_floor_tickets)) {
        g_floor_epoch = epoch;
        g_floor_tickets[0] = 0;
        g_floor_tickets[1] = 0;
        if (parts & kEndFence) __threadfence();
      }
    }
  }
}

template <FloorMode kMode>
ffi::Error LaunchFloorExecute(cudaStream_t stream, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> out, int32_t parts) {
  // The combinations benchmarks/launch_floor_pdl.py uses: a start scheme
  // (kStartCount, kStartTicket) replaces the epoch read and the end ticket.
  switch (parts) {
    case 0: case kEpochRead: case kEndTicket: case kEndTicket | kEndFence:
    case kEpochRead | kEndTicket: case kEpochRead | kEndTicket | kEndFence:
    case kStartCount: case kStartTicket:
      break;
    default:
      return ffi::Error::InvalidArgument("launch_floor: parts=" + std::to_string(parts) +
                                         " combines bookkeeping schemes that share a counter");
  }
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  const size_t vectors = bytes / 16;
  const int blocks = static_cast<int>(std::min<size_t>(132, (vectors + 511) / 512 + 1));
  const char* in = static_cast<const char*>(x.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned int>(blocks));
  config.blockDim = dim3(512);
  config.stream = stream;
  config.attrs = &pdl;
  config.numAttrs = kMode == FloorMode::kPdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(
      &config, CopyKernel<kMode>, reinterpret_cast<const uint4*>(in), reinterpret_cast<uint4*>(o),
      vectors, in + vectors * 16, o + vectors * 16, bytes % 16, static_cast<int>(parts));
  if (err != cudaSuccess) return CudaError(err, "CopyKernel launch", __FILE__, __LINE__);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyKernel launch");
  return ffi::Error::Success();
}

// The plain and PDL copies take no attribute (parts are the bookkeeping's).
template <FloorMode kMode>
ffi::Error CopyOnly(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  return LaunchFloorExecute<kMode>(stream, x, out, /*parts=*/0);
}

}  // namespace

}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloor, jaxoverlap::CopyOnly<jaxoverlap::FloorMode::kPlain>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>(),  // out: a copy of x
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloorPdl, jaxoverlap::CopyOnly<jaxoverlap::FloorMode::kPdl>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>(),  // out: a copy of x
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloorBookkeeping,
    jaxoverlap::LaunchFloorExecute<jaxoverlap::FloorMode::kBookkeeping>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>()   // out: a copy of x
        .Attr<int32_t>("parts"),      // which bookkeeping: kEpochRead | kEndTicket | ... above
    {xla::ffi::Traits::kCmdBufferCompatible});
