// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// CommFuse's fused compute-communication ops over one node's group of PEs:
// the collective is cut into peer-to-peer shard transfers on a second,
// high-priority stream, and the GEMM into shard GEMMs (cuBLASLt) on XLA's
// stream, in the rank-adaptive order.
//
// Source: R. Karim, A. Wen, W. Zongzuo, W. Zhang, Y. Liu, W. Ahmed, "CommFuse:
// Hiding Tail Latency via Communication Decomposition and Fusion for
// Distributed LLM Training", arXiv 2604.24013 (2026; its v1 was titled
// "FlashOverlap: Minimizing Tail Latency in Communication Overlap for
// Distributed LLM Training", not the FlashOverlap of arXiv 2504.19519),
// sec. 3: AllGather+GEMM multiplies the local shard first and the others'
// shards as they arrive;
// GEMM+ReduceScatter computes the blocks other ranks own first and sends each
// while it goes on, and its own block last, so the last transfer is hidden;
// GEMM+AllReduce is GEMM+ReduceScatter followed by an all-gather. The code is
// written here from the paper's description (docs/design.md, "References").
//
// Schedule at ring step i (1..size-1): rank r sends to r+i and receives from
// r-i, so every link carries one transfer per step (rank rotation).
//
// Streams: XLA's stream ("compute") runs the GEMMs and the waits for arriving
// data; the runtime's comm stream runs the transfers. Each call forks the
// comm stream from the compute stream with an event and joins it back at the
// end, so calls never overlap each other and the fork/join is captured
// correctly when XLA records the call into a CUDA graph.
//
// Completion and reuse: each ordered pair of PEs counts the fused calls it
// shares (overlap_epochs, device memory, advanced by a one-thread kernel at
// the start of the call, so graph replays see fresh epochs). A sender writes
// its payload into ONE slot of the receiver, indexed by the sender's local
// rank, and sets the chunk's flag to the epoch E. After its last read of the
// slot (end of the call) the receiver sets the sender's ack flag to E; a
// sender waits for ack >= E-1 before its first write of call E. Slot
// addresses are therefore the same in every call (copy-engine transfers can
// be captured into a graph), and no receiver is overwritten while it reads.
// Deadlock-free: the receiver's call E-1 needs only transfers of call E-1,
// all of which precede the sender's wait in call E.
//
// Waits are bounded (runtime timeout) and report rank, peer PE, step and
// chunk: step = ring step i for data, 0 for the previous call's ack.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <string>

#include "jaxoverlap/check.h"
#include "jaxoverlap/device_utils.cuh"
#include "jaxoverlap/gemm.h"
#include "jaxoverlap/overlap.h"
#include "jaxoverlap/runtime.h"
#include "jaxoverlap/transport.cuh"

namespace jaxoverlap::overlap {

namespace {

constexpr int kPutBlocks = 16;
constexpr int kPutThreads = 512;
constexpr int kAddThreads = 256;
constexpr int kCopyThreads = 256;

// Flag sets: the first transfer of a call (AG's shards, RS's partials), and
// GEMM+AR's second one (the all-gather of the reduced blocks).
constexpr int kPhaseMain = 0;
constexpr int kPhaseAllGather = 1;

size_t ElementBytes(ffi::DataType t) {
  return t == ffi::DataType::F32 ? 4 : 2;
}

// Symmetric addresses, the same offsets on every PE.
uint64_t* DataFlag(const RuntimeState& s, int sender_local, int phase, int chunk) {
  return s.oflags + (static_cast<size_t>(sender_local) * kNumOverlapPhases + phase) * kMaxChunks +
         chunk;
}
char* Slot(const RuntimeState& s, int index) {
  return s.oslots + static_cast<size_t>(index) * s.overlap_slot_bytes;
}

// ---------------------------------------------------------------- kernels

// Advances the pair epochs of this call's peers; call_epochs[j] = E with rank j.
__global__ void BeginKernel(uint64_t* overlap_epochs, uint64_t* call_epochs, Group g) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int j = 0; j < g.size; ++j) {
    if (j == g.rank) continue;
    const uint64_t e = overlap_epochs[g.pes[j]] + 1;
    overlap_epochs[g.pes[j]] = e;
    call_epochs[j] = e;
  }
}

// Sets `flag` on `pe` to this call's epoch with rank j, after all earlier
// work on the stream (the copy engine's transfer) is complete.
__global__ void SignalKernel(PeerMap peers, uint64_t* flag, const uint64_t* call_epochs, int j,
                             int pe) {
  SignalSet(peers, flag, call_epochs[j], pe);  // fences first: a release
}

// Tells every peer that this PE is done reading its slot in this call.
__global__ void AckKernel(PeerMap peers, uint64_t* my_ack_flag, const uint64_t* call_epochs,
                          Group g) {
  const int j = threadIdx.x;
  if (j >= g.size || j == g.rank) return;
  SignalSet(peers, my_ack_flag, call_epochs[j], g.pes[j]);  // fences first: a release
}

// Block b waits until flags[b] >= (epoch with rank j) - lag.
__global__ void WaitKernel(const uint64_t* flags, const uint64_t* call_epochs, int j,
                           uint64_t lag, uint64_t timeout_ns, DeviceError* error, OpId op,
                           int rank, int peer_pe, int step, int first_chunk) {
  if (threadIdx.x != 0) return;
  const uint64_t expected = call_epochs[j] - lag;
  WaitFlagOrTrap(flags + blockIdx.x, expected, timeout_ns, error, op, rank, peer_pe, step,
                 first_chunk + static_cast<int>(blockIdx.x));
}

// NVSHMEM block puts of `height` rows of `width` bytes; the last block to
// finish raises the receiver's flag.
__global__ void __launch_bounds__(kPutThreads)
    PutKernel(char* dst, const char* src, size_t width, size_t height, size_t src_pitch,
              size_t dst_pitch, int pe, uint64_t* flag, const uint64_t* call_epochs, int j,
              unsigned int* counter) {
  const size_t segs = std::max<size_t>(1, (gridDim.x + height - 1) / height);
  const size_t seg_bytes = ((width + segs - 1) / segs + 15) / 16 * 16;
  for (size_t item = blockIdx.x; item < height * segs; item += gridDim.x) {
    const size_t row = item / segs;
    const size_t off = (item % segs) * seg_bytes;
    if (off >= width) continue;
    const size_t len = std::min(seg_bytes, width - off);
    nvshmemx_putmem_block(dst + row * dst_pitch + off, src + row * src_pitch + off, len, pe);
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    __threadfence_system();
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {
      *counter = 0;
      __threadfence_system();
      nvshmemx_signal_op(flag, call_epochs[j], NVSHMEM_SIGNAL_SET, pe);
    }
  }
}

template <typename T>
struct Sources {
  const T* p[kMaxGroupSize];
  int count;
};

// out[i] = out[i] + sum_s src_s[i], in float32 with one rounding, the
// sources added in the order given (the same on every call).
template <typename T>
__global__ void __launch_bounds__(kAddThreads)
    AddKernel(T* out, Sources<T> src, size_t n, bool vectorized) {
  constexpr int kV = 16 / sizeof(T);
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vectorized) {
    const size_t nv = n / kV;
    for (size_t i = tid; i < nv; i += stride) {
      uint4 o = reinterpret_cast<const uint4*>(out)[i];
      T* ot = reinterpret_cast<T*>(&o);
      float acc[kV];
#pragma unroll
      for (int e = 0; e < kV; ++e) acc[e] = ToFloat(ot[e]);
      for (int s = 0; s < src.count; ++s) {
        const uint4 v = reinterpret_cast<const uint4*>(src.p[s])[i];
        const T* vt = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int e = 0; e < kV; ++e) acc[e] += ToFloat(vt[e]);
      }
#pragma unroll
      for (int e = 0; e < kV; ++e) ot[e] = FromFloat<T>(acc[e]);
      reinterpret_cast<uint4*>(out)[i] = o;
    }
    done = nv * kV;
  }
  for (size_t i = done + tid; i < n; i += stride) {
    float acc = ToFloat(out[i]);
    for (int s = 0; s < src.count; ++s) acc += ToFloat(src.p[s][i]);
    out[i] = FromFloat<T>(acc);
  }
}

// Copies `height` rows of `width` bytes between pitched buffers, one `Unit`
// (16, 8, 4, 2 or 1 bytes: the widest that divides both addresses, the width
// and both pitches) per thread and step.
template <typename Unit>
__global__ void __launch_bounds__(kCopyThreads)
    CopyRowsKernel(char* dst, size_t dst_pitch, const char* src, size_t src_pitch, size_t width,
                   size_t height) {
  const size_t per_row = width / sizeof(Unit);
  const size_t total = per_row * height;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const size_t row = i / per_row, off = (i % per_row) * sizeof(Unit);
    *reinterpret_cast<Unit*>(dst + row * dst_pitch + off) =
        *reinterpret_cast<const Unit*>(src + row * src_pitch + off);
  }
}

// ---------------------------------------------------------------- host side

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
ffi::Error LaunchAdd(cudaStream_t stream, void* out, const char* const* srcs, int count,
                     size_t n) {
  Sources<T> src{};
  bool vec = Aligned16(out);
  for (int s = 0; s < count; ++s) {
    src.p[s] = reinterpret_cast<const T*>(srcs[s]);
    vec = vec && Aligned16(srcs[s]);
  }
  src.count = count;
  const size_t work = vec ? n / (16 / sizeof(T)) : n;
  const int blocks = static_cast<int>(
      std::max<size_t>(1, std::min<size_t>(132 * 8, (work + kAddThreads - 1) / kAddThreads)));
  AddKernel<T><<<blocks, kAddThreads, 0, stream>>>(static_cast<T*>(out), src, n, vec);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("AddKernel launch");
  return ffi::Error::Success();
}

ffi::Error Add(cudaStream_t stream, ffi::DataType dtype, void* out, const char* const* srcs,
               int count, size_t n) {
  if (count == 0 || n == 0) return ffi::Error::Success();
  switch (dtype) {
    case ffi::DataType::F32: return LaunchAdd<float>(stream, out, srcs, count, n);
    case ffi::DataType::BF16: return LaunchAdd<__nv_bfloat16>(stream, out, srcs, count, n);
    case ffi::DataType::F16: return LaunchAdd<__half>(stream, out, srcs, count, n);
    default: return ffi::Error::InvalidArgument("fused op: unsupported dtype");
  }
}

// A device-to-device copy of `height` rows of `width` bytes on `stream`: one
// 1-D cudaMemcpyAsync where the rows are contiguous, else CopyRowsKernel.
// Never a 2-D memcpy: when XLA records the call into a CUDA graph and later
// updates it for new buffer addresses, CUDA cannot update a 2-D memcpy node
// (cudaGraphExecUpdate fails), while it can update 1-D copies and kernels.
// Cost: the kernel takes SMs that a 2-D copy on the copy engines would not
// (gathered copies of a gpu_small training step: 3.7 ms as this kernel, 3.5 ms
// as 2-D copies, docs/kernels.md "CUDA graphs"); a 2-D copy outside stream
// capture would get that back, not yet done.
ffi::Error CopyRows(cudaStream_t stream, char* dst, size_t dst_pitch, const char* src,
                    size_t src_pitch, size_t width, size_t height) {
  if (width == 0 || height == 0) return ffi::Error::Success();
  if (height == 1 || (width == dst_pitch && width == src_pitch)) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, width * height, cudaMemcpyDeviceToDevice, stream));
    return ffi::Error::Success();
  }
  // The widest unit that divides everything: the lowest set bit of their OR.
  const size_t all = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | width |
                     dst_pitch | src_pitch;
  const size_t unit = std::min<size_t>(16, all & (~all + 1));
  const size_t work = width / unit * height;
  const int blocks = static_cast<int>(
      std::max<size_t>(1, std::min<size_t>(132 * 2, (work + kCopyThreads - 1) / kCopyThreads)));
  switch (unit) {
    case 16:
      CopyRowsKernel<uint4><<<blocks, kCopyThreads, 0, stream>>>(dst, dst_pitch, src, src_pitch,
                                                                 width, height);
      break;
    case 8:
      CopyRowsKernel<uint2><<<blocks, kCopyThreads, 0, stream>>>(dst, dst_pitch, src, src_pitch,
                                                                 width, height);
      break;
    case 4:
      CopyRowsKernel<uint32_t><<<blocks, kCopyThreads, 0, stream>>>(dst, dst_pitch, src,
                                                                    src_pitch, width, height);
      break;
    case 2:
      CopyRowsKernel<uint16_t><<<blocks, kCopyThreads, 0, stream>>>(dst, dst_pitch, src,
                                                                    src_pitch, width, height);
      break;
    default:
      CopyRowsKernel<unsigned char><<<blocks, kCopyThreads, 0, stream>>>(dst, dst_pitch, src,
                                                                         src_pitch, width, height);
  }
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyRowsKernel launch");
  return ffi::Error::Success();
}

// Makes `to` wait for the work enqueued on `from` so far.
ffi::Error Handoff(cudaEvent_t ev, cudaStream_t from, cudaStream_t to) {
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, from));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(to, ev, 0));
  return ffi::Error::Success();
}

// The shared context of one call.
struct Call {
  const RuntimeState& s;
  const Group& g;
  const Options& opt;
  cudaStream_t compute;
  const char* op;
  OpId op_id;
  int my_local() const { return g.local[g.rank]; }
};

// Checks what could fail half-way through a call before any work is enqueued
// (a call that stopped after its first transfer would leave its peers waiting).
ffi::Error Precheck(const Call& c) {
  if (c.opt.transport == Transport::kNvshmem && c.s.mode != Mode::kNvshmem) {
    return ffi::Error::InvalidArgument(
        std::string(c.op) + ": transport 'nvshmem' needs the NVSHMEM runtime (one GPU per "
        "process); this process drives its GPUs in-process: use transport 'copy_engine'");
  }
  // Both transports need every peer load/store-reachable: the copy engines
  // write into the peer's slots, and NVSHMEM's puts read XLA's buffers, which a
  // network transport of NVSHMEM could only read registered (they are not).
  for (int j = 0; j < c.g.size; ++j) {
    if (j == c.g.rank || PeerAddress(c.s.peers, c.s.oslots, c.g.pes[j]) != nullptr) continue;
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(c.op) + ": the fused ops need every peer of the group "
                          "load/store-reachable (NVLink or PCIe peer access), and peer PE " +
                          std::to_string(c.g.pes[j]) +
                          " is not (with either transport); run this op with backend 'xla'");
  }
  return ffi::Error::Success();
}

// After Precheck and the preloads: the call's first enqueued step of its own.
ffi::Error Begin(const Call& c) {
  BeginKernel<<<1, 1, 0, c.compute>>>(c.s.overlap_epochs, c.s.call_epochs, c.g);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("BeginKernel launch");
  return Handoff(c.s.events[0], c.compute, c.s.comm_stream);  // fork
}

// From Begin on, a call that returns an error has enqueued part of its work:
// its epochs moved on without its sends (the peers will time out waiting for
// them), so the runtime refuses every later call (RecordBrokenCall). Declared
// right before Begin; the call's last step passes through Passed().
class BrokenUnlessPassed {
 public:
  explicit BrokenUnlessPassed(const Call& c) : c_(c) {}
  BrokenUnlessPassed(const BrokenUnlessPassed&) = delete;
  BrokenUnlessPassed& operator=(const BrokenUnlessPassed&) = delete;
  ~BrokenUnlessPassed() {
    if (!passed_) {
      RecordBrokenCall(std::string("an earlier ") + c_.op + " call failed on PE " +
                       std::to_string(c_.s.my_pe) + " after it had begun (that call's error "
                       "says why); its epochs are out of step with its peers': restart the "
                       "processes");
    }
  }
  ffi::Error Passed(ffi::Error e) {
    passed_ = e.success();
    return e;
  }

 private:
  const Call& c_;
  bool passed_ = false;
};

ffi::Error End(const Call& c) {
  JAXOVERLAP_RETURN_IF_ERROR(Handoff(c.s.events[1], c.s.comm_stream, c.compute));  // join
  AckKernel<<<1, kMaxGroupSize, 0, c.compute>>>(c.s.peers, c.s.oacks + c.my_local(),
                                                c.s.call_epochs, c.g);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("AckKernel launch");
  return ffi::Error::Success();
}

// Waits, on `stream`, for `count` flags from rank j, from chunk `first` on.
ffi::Error Wait(const Call& c, cudaStream_t stream, const uint64_t* flags, int count, int j,
                uint64_t lag, int step, int first) {
  WaitKernel<<<count, 1, 0, stream>>>(flags, c.s.call_epochs, j, lag, c.s.timeout_ns,
                                      c.s.error_device, c.op_id, c.g.rank, c.g.pes[j], step,
                                      first);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("WaitKernel launch");
  return ffi::Error::Success();
}

// Before the first write of this call into rank j's slot (on the comm stream).
ffi::Error WaitAck(const Call& c, int j) {
  return Wait(c, c.s.comm_stream, c.s.oacks + c.g.local[j], 1, j, 1, 0, 0);
}

// Sends `height` rows of `width` bytes from local `src` to the symmetric
// `dst` on rank j, then sets the symmetric `flag` there, on the comm stream.
ffi::Error Send(const Call& c, int j, char* dst, const char* src, size_t width, size_t height,
                size_t src_pitch, size_t dst_pitch, uint64_t* flag) {
  const int pe = c.g.pes[j];
  cudaStream_t comm = c.s.comm_stream;
  if (c.opt.transport == Transport::kCopyEngine) {
    char* peer = PeerAddress(c.s.peers, dst, pe);
    if (peer == nullptr) {  // Precheck() makes this unreachable
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string(c.op) + ": no peer mapping of PE " + std::to_string(pe));
    }
    if (height == 1 || (width == src_pitch && width == dst_pitch)) {
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(peer, src, width * height, cudaMemcpyDeviceToDevice, comm));
    } else {
      // Only between fixed symmetric addresses (RS's staging and slots): a
      // graph cannot update a 2-D copy to new addresses (CopyRows).
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(peer, dst_pitch, src, src_pitch, width,
                                                        height, cudaMemcpyDeviceToDevice, comm));
    }
    SignalKernel<<<1, 1, 0, comm>>>(c.s.peers, flag, c.s.call_epochs, j, pe);
    JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("SignalKernel launch");
  } else {
    PutKernel<<<kPutBlocks, kPutThreads, 0, comm>>>(dst, src, width, height, src_pitch, dst_pitch,
                                                    pe, flag, c.s.call_epochs, j,
                                                    c.s.put_counter);
    JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("PutKernel launch");
  }
  return ffi::Error::Success();
}

ffi::Error CheckSlot(const Call& c, const char* what, size_t need) {
  if (need <= c.s.overlap_slot_bytes) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    std::string(c.op) + ": " + what + " needs " + std::to_string(need) +
                        " bytes of fused-op slot per sender, but the slot has " +
                        std::to_string(c.s.overlap_slot_bytes) +
                        " bytes; raise overlap_heap_bytes in jaxoverlap.initialize() "
                        "(JAXOVERLAP_OVERLAP_HEAP_BYTES)");
}

int Chunks(const Options& opt, int64_t rows) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(opt.chunks), static_cast<int64_t>(kMaxChunks),
                            rows})));
}

int64_t ChunkStart(int64_t rows, int chunks, int q) { return rows * q / chunks; }

gemm::Gemm ShardGemm(const Call& c, ffi::DataType dtype, const void* a, const void* w, void* d,
                     int64_t rows, int64_t k, int64_t n, int64_t batch, int64_t stride_a,
                     int64_t stride_d) {
  gemm::Gemm g;
  g.dtype = dtype;
  g.precision = c.opt.precision;
  g.device = c.s.device;
  g.rows = rows;
  g.n = n;
  g.k = k;
  g.lda = k;
  g.ldb = n;
  g.ldd = n;
  g.batch = batch;
  g.stride_a = stride_a;
  g.stride_d = stride_d;
  g.a = a;
  g.b = w;
  g.d = d;
  return g;
}

// Sends this rank's reduced chunk q (rows [q0, q1) of `own`) to every peer's
// all-gather half-slot (GEMM+AR's all-gather), after the work on the compute
// stream so far.
ffi::Error SendReducedChunk(const Call& c, const char* own, size_t half, int64_t q0, int64_t q1,
                            int64_t n, size_t es, int q) {
  const RuntimeState& s = c.s;
  JAXOVERLAP_RETURN_IF_ERROR(Handoff(s.events[0], c.compute, s.comm_stream));
  for (int i = 1; i < c.g.size; ++i) {
    const int dest = (c.g.rank + i) % c.g.size;
    const size_t bytes = (q1 - q0) * n * es;
    JAXOVERLAP_RETURN_IF_ERROR(Send(c, dest, Slot(s, c.my_local()) + half + q0 * n * es,
                                    own + q0 * n * es, bytes, 1, bytes, bytes,
                                    DataFlag(s, c.my_local(), kPhaseAllGather, q)));
  }
  return ffi::Error::Success();
}

// The reduce-scatter half shared by GEMM+RS and GEMM+AR: partial blocks for
// the other ranks first (each chunk sent as soon as its GEMM is done), this
// rank's block last into `own`. Rank r-1 computes r's partial first, so it
// arrives first: each chunk of r's own GEMM waits for that chunk of it and
// adds it in the GEMM's epilogue (D = A @ B + C, one rounding); partials of
// further ranks (groups of more than 2) are added afterwards. With
// `ag_half` > 0 (GEMM+AR) each finished chunk of the reduced block is then
// sent to every peer's all-gather half-slot at offset `ag_half`.
//
// The phase's GEMMs: chunk q of the partial block for the rank i steps ahead
// (into staging buffer (i-1) % 2), and chunk q of this rank's own block (its
// epilogue adds rank r-1's partial from its slot).
struct ReduceScatterGemms {
  const Call& c;
  ffi::DataType dtype;
  const char* x;
  const void* w;
  char* own;
  int64_t outer, rows, k, n;
  int chunks;

  char* Staging(int i) const {
    return i % 2 == 1 ? Slot(c.s, c.my_local()) : Slot(c.s, c.s.ranks_per_node);
  }
  gemm::Gemm Partial(int i, int q) const {
    const size_t es = ElementBytes(dtype);
    const int dest = (c.g.rank + i) % c.g.size;
    const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
    return ShardGemm(c, dtype, x + (dest * rows + q0) * k * es, w, Staging(i) + q0 * n * es,
                     q1 - q0, k, n, outer, c.g.size * rows * k, rows * n);
  }
  gemm::Gemm Own(int q) const {
    const size_t es = ElementBytes(dtype);
    const int r = c.g.rank, first = (r - 1 + c.g.size) % c.g.size;
    const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
    gemm::Gemm g = ShardGemm(c, dtype, x + (r * rows + q0) * k * es, w, own + q0 * n * es,
                             q1 - q0, k, n, outer, c.g.size * rows * k, rows * n);
    g.c = Slot(c.s, c.g.local[first]) + q0 * n * es;
    return g;
  }
  // fn(g) for every GEMM of the phase, up to the first failure.
  template <typename Fn>
  ffi::Error ForEach(Fn fn) const {
    for (int i = 1; i < c.g.size; ++i) {
      for (int q = 0; q < chunks; ++q) JAXOVERLAP_RETURN_IF_ERROR(fn(Partial(i, q)));
    }
    for (int q = 0; q < chunks; ++q) JAXOVERLAP_RETURN_IF_ERROR(fn(Own(q)));
    return ffi::Error::Success();
  }
  // Every plan first, so that a GEMM cuBLASLt cannot run fails before any
  // runs (no output left partly written); then the preloads, before the
  // phase's first wait (gemm::Preload says why). Running them early is safe:
  // the staging buffers and `own` are this rank's and the call rewrites them;
  // C is only read.
  ffi::Error Preload() const {
    JAXOVERLAP_RETURN_IF_ERROR(ForEach([](const gemm::Gemm& g) { return gemm::Plan(g); }));
    return ForEach([this](const gemm::Gemm& g) { return gemm::Preload(c.compute, g); });
  }
};

ffi::Error ReduceScatterPhase(const Call& c, const ReduceScatterGemms& gemms, size_t ag_half) {
  const RuntimeState& s = c.s;
  const int size = c.g.size, r = c.g.rank;
  const ffi::DataType dtype = gemms.dtype;
  const size_t es = ElementBytes(dtype);
  const int64_t outer = gemms.outer, rows = gemms.rows, n = gemms.n;
  char* own = gemms.own;
  const int chunks = gemms.chunks;
  cudaEvent_t staging_free[2] = {s.events[2], s.events[3]};
  const size_t block_pitch = static_cast<size_t>(rows) * n * es;  // one outer of a block
  for (int i = 1; i < size; ++i) {
    const int dest = (r + i) % size;
    const int b = (i - 1) % 2;
    if (i >= 3) {
      // The transfers of step i-2 read this staging buffer.
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(c.compute, staging_free[b], 0));
    }
    JAXOVERLAP_RETURN_IF_ERROR(WaitAck(c, dest));
    for (int q = 0; q < chunks; ++q) {
      const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
      JAXOVERLAP_RETURN_IF_ERROR(gemm::Run(c.compute, gemms.Partial(i, q)));
      JAXOVERLAP_RETURN_IF_ERROR(Handoff(s.events[0], c.compute, s.comm_stream));
      JAXOVERLAP_RETURN_IF_ERROR(Send(c, dest, Slot(s, c.my_local()) + q0 * n * es,
                                      gemms.Staging(i) + q0 * n * es, (q1 - q0) * n * es, outer,
                                      block_pitch, block_pitch,
                                      DataFlag(s, c.my_local(), kPhaseMain, q)));
    }
    if (i + 2 < size) {
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free[b], s.comm_stream));
    }
  }
  // This rank's block, chunk by chunk, plus the first partial in the epilogue.
  const int first = (r - 1 + size) % size;
  for (int q = 0; q < chunks; ++q) {
    const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
    JAXOVERLAP_RETURN_IF_ERROR(Wait(c, c.compute, DataFlag(s, c.g.local[first], kPhaseMain, q),
                                    1, first, 0, 1, q));
    JAXOVERLAP_RETURN_IF_ERROR(gemm::Run(c.compute, gemms.Own(q)));
    if (ag_half > 0 && size == 2) {
      JAXOVERLAP_RETURN_IF_ERROR(SendReducedChunk(c, own, ag_half, q0, q1, n, es, q));
    }
  }
  if (size > 2) {
    const char* partials[kMaxGroupSize];
    for (int i = 2; i < size; ++i) {
      const int src = (r - i + size) % size;
      JAXOVERLAP_RETURN_IF_ERROR(Wait(c, c.compute, DataFlag(s, c.g.local[src], kPhaseMain, 0),
                                      chunks, src, 0, i, 0));
      partials[i - 2] = Slot(s, c.g.local[src]);
    }
    JAXOVERLAP_RETURN_IF_ERROR(
        Add(c.compute, dtype, own, partials, size - 2, static_cast<size_t>(outer) * rows * n));
    if (ag_half > 0) {
      for (int q = 0; q < chunks; ++q) {
        JAXOVERLAP_RETURN_IF_ERROR(SendReducedChunk(c, own, ag_half, ChunkStart(rows, chunks, q),
                                                    ChunkStart(rows, chunks, q + 1), n, es, q));
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckDtype(const char* op, ffi::DataType dtype) {
  if (dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 ||
      dtype == ffi::DataType::F16) {
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument(std::string(op) +
                                     ": dtype must be float32, bfloat16 or float16");
}

}  // namespace

ffi::Error MakeGroup(const RuntimeState& s, const char* op, ffi::Span<const int64_t> groups,
                     int64_t group_size, Group* group) {
  const size_t entries = groups.size();
  if (group_size < 2 || group_size > kMaxGroupSize || entries % group_size != 0) {
    // One rank has nothing to send: the dispatcher plans the plain GEMM there.
    return ffi::Error::InvalidArgument(std::string(op) + ": group size " +
                                       std::to_string(group_size) + " with " +
                                       std::to_string(entries) + " PE entries; 2.." +
                                       std::to_string(kMaxGroupSize) + " ranks are supported");
  }
  for (size_t start = 0; start < entries; start += group_size) {
    for (int64_t r = 0; r < group_size; ++r) {
      if (groups[start + r] != s.my_pe) continue;
      Group g;
      g.size = static_cast<int>(group_size);
      g.rank = static_cast<int>(r);
      for (int64_t m = 0; m < group_size; ++m) {
        const int64_t pe = groups[start + m];
        if (pe < 0 || pe >= s.num_pes) {
          return ffi::Error::InvalidArgument(std::string(op) + ": group names PE " +
                                             std::to_string(pe) + " but the runtime has " +
                                             std::to_string(s.num_pes) + " PEs");
        }
        for (int64_t earlier = 0; earlier < m; ++earlier) {
          if (groups[start + earlier] == pe) {
            return ffi::Error::InvalidArgument(std::string(op) + ": the group names PE " +
                                               std::to_string(pe) + " twice");
          }
        }
        if (pe / s.ranks_per_node != s.my_pe / s.ranks_per_node) {
          return ffi::Error::InvalidArgument(
              std::string(op) + ": PE " + std::to_string(pe) + " of the group is on another node "
              "than PE " + std::to_string(s.my_pe) + " (ranks_per_node=" +
              std::to_string(s.ranks_per_node) + "); the fused ops run within one node (TP)");
        }
        g.pes[m] = static_cast<int>(pe);
        g.local[m] = static_cast<int>(pe % s.ranks_per_node);
      }
      *group = g;
      return ffi::Error::Success();
    }
  }
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(op) + ": PE " + std::to_string(s.my_pe) +
                        " is in none of the groups of this call; the mesh's devices and the "
                        "runtime's PEs disagree (jaxoverlap.runtime.pe_of_device)");
}

ffi::Error AllGatherMatmul(const RuntimeState& s, cudaStream_t stream, const Group& group,
                           const Options& opt, ffi::DataType dtype, const void* x_ptr,
                           const void* w, void* out_ptr, void* gathered_ptr, int64_t outer,
                           int64_t rows, int64_t k, int64_t n) {
  const Call c{s, group, opt, stream, "all_gather_matmul", OpId::kAllGatherMatmul};
  JAXOVERLAP_RETURN_IF_ERROR(CheckDtype(c.op, dtype));
  const size_t es = ElementBytes(dtype);
  const int size = group.size, r = group.rank;
  const char* x = static_cast<const char*>(x_ptr);
  char* out = static_cast<char*>(out_ptr);
  char* gathered = static_cast<char*>(gathered_ptr);
  const size_t shard_pitch = static_cast<size_t>(rows) * k * es;  // one outer of a shard
  JAXOVERLAP_RETURN_IF_ERROR(CheckSlot(c, "the shard of x", outer * shard_pitch));
  // Chunks are rows of the shard without batch dims (outer == 1) and whole
  // batch entries with them, so that each chunk is one contiguous range of x
  // and of the slot: one 1-D copy (CopyRows says why not 2-D).
  const bool by_batch = outer > 1;
  const int chunks = Chunks(opt, by_batch ? outer : rows);
  struct Piece {
    size_t offset, bytes;  // in the shard (x) and in the slot
    int64_t out_offset;    // elements of out, for rank 0's shard
    int64_t rows, batch;
  };
  auto piece = [&](int q) {
    if (by_batch) {
      const int64_t o0 = ChunkStart(outer, chunks, q), o1 = ChunkStart(outer, chunks, q + 1);
      return Piece{o0 * shard_pitch, (o1 - o0) * shard_pitch, o0 * size * rows * n, rows,
                   o1 - o0};
    }
    const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
    return Piece{q0 * k * es, (q1 - q0) * k * es, q0 * n, q1 - q0, 1};
  };

  // The GEMMs: the local shard, and chunk q of the shard of the rank i steps behind.
  const gemm::Gemm own = ShardGemm(c, dtype, x, w, out + r * rows * n * es, rows, k, n, outer,
                                   rows * k, size * rows * n);
  auto chunk_gemm = [&](int i, int q) {
    const int src = (r - i + size) % size;
    const Piece p = piece(q);
    return ShardGemm(c, dtype, Slot(s, group.local[src]) + p.offset, w,
                     out + (p.out_offset + src * rows * n) * es, p.rows, k, n, p.batch, rows * k,
                     size * rows * n);
  };
  // Nothing runs before the checks and every GEMM's plan (no output left
  // partly written). Then the preloads, all before the first wait
  // (gemm::Preload says why); they write only `out`, which the call rewrites,
  // and read slots that may be half-written.
  JAXOVERLAP_RETURN_IF_ERROR(Precheck(c));
  for (const bool run : {false, true}) {
    const auto prepare = [&](const gemm::Gemm& g) {
      return run ? gemm::Preload(stream, g) : gemm::Plan(g);
    };
    JAXOVERLAP_RETURN_IF_ERROR(prepare(own));
    for (int i = 1; i < size; ++i) {
      for (int q = 0; q < chunks; ++q) JAXOVERLAP_RETURN_IF_ERROR(prepare(chunk_gemm(i, q)));
    }
  }

  BrokenUnlessPassed broken_unless_passed(c);
  JAXOVERLAP_RETURN_IF_ERROR(Begin(c));
  // Comm stream: this rank's shard to ranks r+1, r+2, ... chunk by chunk.
  for (int i = 1; i < size; ++i) {
    const int dest = (r + i) % size;
    JAXOVERLAP_RETURN_IF_ERROR(WaitAck(c, dest));
    for (int q = 0; q < chunks; ++q) {
      const Piece p = piece(q);
      JAXOVERLAP_RETURN_IF_ERROR(Send(c, dest, Slot(s, c.my_local()) + p.offset, x + p.offset,
                                      p.bytes, 1, p.bytes, p.bytes,
                                      DataFlag(s, c.my_local(), kPhaseMain, q)));
    }
  }
  if (gathered != nullptr) {
    JAXOVERLAP_RETURN_IF_ERROR(CopyRows(s.comm_stream, gathered + r * shard_pitch,
                                        size * shard_pitch, x, shard_pitch, shard_pitch, outer));
  }
  // Compute stream: the local shard first, then the others as they arrive.
  JAXOVERLAP_RETURN_IF_ERROR(gemm::Run(stream, own));
  for (int i = 1; i < size; ++i) {
    const int src = (r - i + size) % size;
    const char* slot = Slot(s, group.local[src]);
    for (int q = 0; q < chunks; ++q) {
      JAXOVERLAP_RETURN_IF_ERROR(
          Wait(c, stream, DataFlag(s, group.local[src], kPhaseMain, q), 1, src, 0, i, q));
      JAXOVERLAP_RETURN_IF_ERROR(gemm::Run(stream, chunk_gemm(i, q)));
    }
    if (gathered != nullptr) {
      JAXOVERLAP_RETURN_IF_ERROR(Handoff(s.events[0], stream, s.comm_stream));
      JAXOVERLAP_RETURN_IF_ERROR(CopyRows(s.comm_stream, gathered + src * shard_pitch,
                                          size * shard_pitch, slot, shard_pitch, shard_pitch,
                                          outer));
    }
  }
  return broken_unless_passed.Passed(End(c));
}

ffi::Error MatmulReduceScatter(const RuntimeState& s, cudaStream_t stream, const Group& group,
                               const Options& opt, ffi::DataType dtype, const void* x,
                               const void* w, void* out, int64_t outer, int64_t rows, int64_t k,
                               int64_t n) {
  const Call c{s, group, opt, stream, "matmul_reduce_scatter", OpId::kMatmulReduceScatter};
  JAXOVERLAP_RETURN_IF_ERROR(CheckDtype(c.op, dtype));
  const size_t es = ElementBytes(dtype);
  JAXOVERLAP_RETURN_IF_ERROR(
      CheckSlot(c, "a partial output block", static_cast<size_t>(outer) * rows * n * es));
  const ReduceScatterGemms gemms{c,     dtype, static_cast<const char*>(x), w,
                                 static_cast<char*>(out), outer, rows,  k, n, Chunks(opt, rows)};
  JAXOVERLAP_RETURN_IF_ERROR(Precheck(c));
  JAXOVERLAP_RETURN_IF_ERROR(gemms.Preload());
  BrokenUnlessPassed broken_unless_passed(c);
  JAXOVERLAP_RETURN_IF_ERROR(Begin(c));
  JAXOVERLAP_RETURN_IF_ERROR(ReduceScatterPhase(c, gemms, 0));
  return broken_unless_passed.Passed(End(c));
}

ffi::Error MatmulAllReduce(const RuntimeState& s, cudaStream_t stream, const Group& group,
                           const Options& opt, ffi::DataType dtype, const void* x, const void* w,
                           void* out_ptr, int64_t rows, int64_t k, int64_t n) {
  const Call c{s, group, opt, stream, "matmul_all_reduce", OpId::kMatmulAllReduce};
  JAXOVERLAP_RETURN_IF_ERROR(CheckDtype(c.op, dtype));
  const size_t es = ElementBytes(dtype);
  const int size = group.size, r = group.rank;
  char* out = static_cast<char*>(out_ptr);
  const size_t block_bytes = static_cast<size_t>(rows) * n * es;
  // The slot holds the reduce-scatter partial and, after it, the all-gather block.
  const size_t half = s.overlap_slot_bytes / 2 / 256 * 256;
  JAXOVERLAP_RETURN_IF_ERROR(
      CheckSlot(c, "a partial and a reduced block", 2 * ((block_bytes + 255) / 256 * 256)));
  const int chunks = Chunks(opt, rows);
  const ReduceScatterGemms gemms{c, dtype, static_cast<const char*>(x), w, out + r * block_bytes,
                                 1, rows, k, n, chunks};
  JAXOVERLAP_RETURN_IF_ERROR(Precheck(c));
  JAXOVERLAP_RETURN_IF_ERROR(gemms.Preload());
  BrokenUnlessPassed broken_unless_passed(c);
  JAXOVERLAP_RETURN_IF_ERROR(Begin(c));
  // The reduce-scatter; each reduced chunk of this rank's block goes to every
  // peer as soon as it is final (acks were awaited before the first send).
  JAXOVERLAP_RETURN_IF_ERROR(ReduceScatterPhase(c, gemms, half));
  // The peers' reduced blocks, chunk by chunk as they arrive, into place.
  for (int i = 1; i < size; ++i) {
    const int src = (r - i + size) % size;
    for (int q = 0; q < chunks; ++q) {
      const int64_t q0 = ChunkStart(rows, chunks, q), q1 = ChunkStart(rows, chunks, q + 1);
      JAXOVERLAP_RETURN_IF_ERROR(Wait(c, stream,
                                      DataFlag(s, group.local[src], kPhaseAllGather, q), 1, src,
                                      0, size - 1 + i, q));
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(out + (src * rows + q0) * n * es,
                          Slot(s, group.local[src]) + half + q0 * n * es, (q1 - q0) * n * es,
                          cudaMemcpyDeviceToDevice, stream));
    }
  }
  return broken_unless_passed.Passed(End(c));
}

ffi::Error PreloadKernels() {
  cudaFuncAttributes a;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, BeginKernel));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, SignalKernel));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, AckKernel));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, WaitKernel));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, PutKernel));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, AddKernel<float>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, AddKernel<__nv_bfloat16>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, AddKernel<__half>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, CopyRowsKernel<uint4>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, CopyRowsKernel<uint2>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, CopyRowsKernel<uint32_t>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, CopyRowsKernel<uint16_t>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, CopyRowsKernel<unsigned char>));
  return ffi::Error::Success();
}

}  // namespace jaxoverlap::overlap
