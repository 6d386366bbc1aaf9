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
//   * "_prefetch" copies on a given number of blocks, issues prefetches of the
//     first bytes of a second operand (a weight the next XLA GEMM reads) into
//     L2, then waits a given time before it ends, as a one-row all-reduce's
//     few blocks wait for their peers: whether a collective's wait can load the
//     next layer's weights into L2 and how much of the GEMM after it that
//     saves (PRESERVE, Yuzuguler et al. 2025, arXiv:2501.08192;
//     benchmarks/l2_prefetch.py).
#include <cuda_runtime.h>

#include <algorithm>
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
constexpr uint64_t kStartWaitNs = 10ull * 1000000000;  // kStartCount's bound on its wait
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
        // Bounded, as every device wait: a grid that cannot start in full (the
        // GPU held by another kernel) stops the probe with a message, not a hang.
        uint32_t started = 0;
        const uint64_t since = GlobalTimerNs();
        for (uint32_t polls = 1;; ++polls) {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(started)
                       : "l"(g_floor_tickets + 1) : "memory");
          if (started >= gridDim.x) break;
          if (polls % 64 == 0 && GlobalTimerNs() - since > kStartWaitNs) {
            printf("jaxoverlap: launch_floor: block 0 waited %llu s for the grid's %u blocks to "
                   "start; %u did\n", static_cast<unsigned long long>(kStartWaitNs / 1000000000),
                   gridDim.x, started);
            __trap();
          }
        }
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

// The copies write x.size_bytes() into out, by 16-byte vectors: out must be as
// large, and both 16-byte aligned (XLA's buffers are).
ffi::Error CheckCopy(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& out) {
  if (out.size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": out has " +
                                       std::to_string(out.size_bytes()) + " bytes, x " +
                                       std::to_string(x.size_bytes()) + "; they must be equal");
  }
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out.untyped_data()) % 16 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x and out must be 16-byte aligned");
  }
  return ffi::Error::Success();
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
  JAXOVERLAP_RETURN_IF_ERROR(CheckCopy("launch_floor", x, *out));
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

// The plain copy with `threads` a block and one 16-byte vector a thread (grid-stride
// beyond 1056 blocks), or with threads == 0 no kernel at all: the output aliases the input
// (jaxoverlap/_cuda.py passes input_output_aliases), so the call is XLA's custom-call node
// with an empty captured graph. Side by side these tell a custom call's own cost in XLA's
// graphs from its kernel's (benchmarks/launch_floor_pdl.py, "Anatomy").
ffi::Error LaunchFloorShaped(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                             int32_t threads) {
  if (threads == 0) {
    if (out->untyped_data() != x.untyped_data()) {
      return ffi::Error::InvalidArgument(
          "launch_floor: threads=0 launches nothing, so the output must alias the input "
          "(input_output_aliases={0: 0})");
    }
    return ffi::Error::Success();
  }
  if (threads < 32 || threads > 1024 || threads % 32 != 0) {
    return ffi::Error::InvalidArgument("launch_floor: threads=" + std::to_string(threads) +
                                       " is not a multiple of 32 in 32..1024");
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckCopy("launch_floor", x, *out));
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  const size_t vectors = bytes / 16;
  const int blocks = static_cast<int>(
      std::max<size_t>(1, std::min<size_t>(1056, (vectors + threads - 1) / threads)));
  const char* in = static_cast<const char*>(x.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  CopyKernel<FloorMode::kPlain><<<blocks, threads, 0, stream>>>(
      reinterpret_cast<const uint4*>(in), reinterpret_cast<uint4*>(o), vectors,
      in + vectors * 16, o + vectors * 16, bytes % 16, 0);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyKernel launch (shaped)");
  return ffi::Error::Success();
}

// How the prefetch variant loads its bytes into L2.
constexpr int kPrefetchNone = 0;
constexpr int kPrefetchBulk = 1;       // cp.async.bulk.prefetch.L2 (Hopper's TMA), chunks
constexpr int kPrefetchLines = 2;      // prefetch.global.L2, one 128-byte line per thread
constexpr int kPrefetchLinesLast = 3;  // prefetch.global.L2::evict_last
// The stand-in wait for peers is a probe's microseconds; one second bounds it.
constexpr int64_t kMaxPrefetchWaitNs = 1000000000;

__global__ void CopyPrefetchKernel(const uint4* in, uint4* out, size_t num_vectors,
                                   const char* in_tail, char* out_tail, size_t tail_bytes,
                                   const char* pref, size_t pref_bytes, int method,
                                   uint32_t chunk, int64_t wait_ns) {
  uint64_t start = 0;
  if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  // This block's share of the prefetch: a contiguous range, so that the
  // blocks together cover the first pref_bytes in order.
  const size_t share = (pref_bytes / gridDim.x + 127) / 128 * 128;
  const size_t lo = std::min(pref_bytes, share * blockIdx.x);
  const size_t hi = std::min(pref_bytes, lo + share);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (method == kPrefetchBulk && threadIdx.x < 32) {  // warp 0 issues the chunks, lane-strided
    for (size_t off = lo + static_cast<size_t>(threadIdx.x) * chunk; off < hi;
         off += static_cast<size_t>(32) * chunk) {
      const uint32_t n = static_cast<uint32_t>(std::min<size_t>(chunk, hi - off)) & ~15u;
      if (n != 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pref + off), "r"(n)
                     : "memory");
      }
    }
  }
#endif
  if (method == kPrefetchLines || method == kPrefetchLinesLast) {
    for (size_t off = lo + static_cast<size_t>(threadIdx.x) * 128; off < hi;
         off += static_cast<size_t>(blockDim.x) * 128) {
      if (method == kPrefetchLines) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(pref + off));
      } else {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(pref + off));
      }
    }
  }
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_vectors;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < tail_bytes) out_tail[threadIdx.x] = in_tail[threadIdx.x];
  if (threadIdx.x == 0 && wait_ns > 0) {  // the stand-in for waiting on peers
    uint64_t now = start;
    while (static_cast<int64_t>(now - start) < wait_ns) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
  }
  __syncthreads();
}

ffi::Error LaunchFloorPrefetch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                               ffi::Result<ffi::AnyBuffer> out, int64_t prefetch_bytes,
                               int32_t method, int32_t blocks, int32_t chunk,
                               int64_t wait_ns) {
  if (method < kPrefetchNone || method > kPrefetchLinesLast || blocks < 1 || blocks > 1024 ||
      chunk < 16 || chunk % 16 != 0 || prefetch_bytes < 0 || wait_ns < 0 ||
      wait_ns > kMaxPrefetchWaitNs ||
      reinterpret_cast<uintptr_t>(weight.untyped_data()) % 16 != 0) {
    return ffi::Error::InvalidArgument(
        "launch_floor_prefetch: method " + std::to_string(method) + ", blocks " +
        std::to_string(blocks) + ", chunk " + std::to_string(chunk) + ", prefetch_bytes " +
        std::to_string(prefetch_bytes) + ", wait_ns " + std::to_string(wait_ns) +
        " (method 0-3, blocks 1-1024, chunk a positive multiple of 16, wait_ns 0-" +
        std::to_string(kMaxPrefetchWaitNs) + ", a 16-byte aligned weight)");
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckCopy("launch_floor_prefetch", x, *out));
  if (method == kPrefetchBulk) {  // Hopper's instruction: refuse it where it would do nothing
    int device = 0, major = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    }
    if (err != cudaSuccess) return CudaError(err, "launch_floor_prefetch: device query",
                                             __FILE__, __LINE__);
    if (major < 9) {
      return ffi::Error::InvalidArgument(
          "launch_floor_prefetch: method 1 (cp.async.bulk.prefetch) needs compute capability "
          "9.0 or newer, this GPU has " + std::to_string(major) + ".x");
    }
  }
  const size_t bytes = x.size_bytes();
  const size_t vectors = bytes / 16;
  const size_t pref = std::min<size_t>(static_cast<size_t>(prefetch_bytes), weight.size_bytes());
  const char* in = static_cast<const char*>(x.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  CopyPrefetchKernel<<<blocks, 256, 0, stream>>>(
      reinterpret_cast<const uint4*>(in), reinterpret_cast<uint4*>(o), vectors, in + vectors * 16,
      o + vectors * 16, bytes % 16, static_cast<const char*>(weight.untyped_data()), pref, method,
      static_cast<uint32_t>(chunk), wait_ns);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyPrefetchKernel launch");
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloorShaped, jaxoverlap::LaunchFloorShaped,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>()   // out: a copy of x (threads=0: x itself, aliased)
        .Attr<int32_t>("threads"),    // threads a block; 0: no kernel
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloorPrefetch, jaxoverlap::LaunchFloorPrefetch,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()        // x: [...] any dtype
        .Arg<xla::ffi::AnyBuffer>()        // weight: [...] any dtype, 16-byte aligned
        .Ret<xla::ffi::AnyBuffer>()        // out: a copy of x
        .Attr<int64_t>("prefetch_bytes")   // the first bytes of weight to prefetch into L2
        .Attr<int32_t>("method")           // kPrefetchNone, kPrefetchBulk, kPrefetchLines, ...
        .Attr<int32_t>("blocks")           // the grid (256 threads a block)
        .Attr<int32_t>("chunk")            // bytes per bulk prefetch
        .Attr<int64_t>("wait_ns"),         // thread 0 of each block waits this long, then ends
    {xla::ffi::Traits::kCmdBufferCompatible});
