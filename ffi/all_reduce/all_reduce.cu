// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// All-reduce kernels over NVSHMEM: one-shot and two-shot within a node, and
// the hierarchical NVRAR algorithm across nodes.
//
// Source: NVRAR, "Understanding and Improving Communication Performance in
// Multi-node LLM Inference", arXiv 2511.09557, sec. 4 (intra-node
// reduce-scatter, inter-node recursive doubling among same-local-rank GPUs
// with one-sided puts and sequence-numbered completion, intra-node
// all-gather). The code is written here from the paper's description. The
// LL8 line layout follows NCCL's LL protocol (two 4-byte words, each with its
// own 4-byte flag; arXiv 2507.04786); one-shot, two-shot and the Lamport
// protocol follow TensorRT-LLM's custom all-reduce kernels (docs/design.md,
// "References").
//
// Completion and reuse, for every algorithm: each ordered pair of PEs keeps a
// call counter, the epoch, in device memory on both sides (pair_epochs),
// advanced once per call in which the pair exchanges data. Payloads land in a
// slot of the receiver indexed by (epoch parity, phase, sender PE); "simple"
// payloads are followed by a flag set to the epoch, LL8 payloads carry the
// epoch in every 8-byte cell. In every algorithm both members of a pair wait
// for each other within a call, so a sender can start call e+2 only after the
// receiver has started call e+1, that is after the receiver's call-e kernel
// (the one reading parity e%2) ended. (Where a pair's shards are both empty,
// as for two ranks past the end of a short message in the shard-based
// kernels, the pair exchanges nothing in that call; the wait is then
// indirect: each waits for local rank 0, whose shard is never empty, and
// rank 0 for them.) Two parities therefore suffice: no
// acknowledgement message, no reset, and the same launch on every call (so
// the handler is CUDA-graph safe). LL8 flags, 32 bits of the epoch, repeat
// every 2^32 calls; the calls at the end of each period re-stamp the cells
// (see "period end" below).
//
// The Lamport protocol (one-shot, two-shot) needs no flag and no epoch in the payload:
// its slots hold kLamportEmpty in every 32-bit word between calls, the sender
// stores plain 16-byte vectors, and the receiver polls each vector until none
// of its words is empty, then writes the empty pattern back. The idea is
// Lamport's (a value that cannot be data marks "not yet written"), as used by
// the one-shot all-reduce of TensorRT-LLM; the code is written here. A word of
// data equal to the pattern is a NaN in every dtype (one fp32 NaN, or two
// bf16/fp16 NaNs) and is sent as another NaN, so sums are unchanged. The same
// two-parity argument covers reuse: the receiver empties a slot within the
// call that reads it, before its next kernel starts.
//
// Every block owns the same sub-range of the data in every phase, so blocks
// never wait for each other (except within a cluster, whose blocks run at
// once: all_reduce_rms_norm's); the last block to finish advances the epochs.
// (The Lamport kernels number their blocks by start order, LamportSetup.)
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/check.h"
#include "jaxoverlap/device_utils.cuh"
#include "jaxoverlap/runtime.h"
#include "jaxoverlap/transport.cuh"

namespace jaxoverlap::all_reduce {

namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kMaxBump = kMaxGroupSize + 8;  // local peers + log2(kMaxNodes) partners + fold
// Payload per block: small enough that mid-size messages spread over many
// SMs (one LL8 line per thread at 4 KiB), measured on 2x H200
// (docs/kernels.md, "all_reduce v3").
constexpr size_t kSimpleBytesPerBlock = 16 * 1024;
constexpr size_t kLLBytesPerBlock = 4 * 1024;
// Lamport grid: 4 KiB per block (half the threads at small sizes), and up to
// as many blocks as the GPU holds at once (RuntimeState::lamport_blocks_per_sm
// x the SMs): the kernels keep their per-peer state in shared memory
// (LamportPeers) and are compiled for kLamportBlocksPerSm 512-thread blocks an
// SM (at most 64 registers a thread), so a message of any size moves in one
// wave, each thread with as many vectors as it takes. (With the per-peer state
// in registers the kernels took 128 registers a thread, one block fitted an
// SM, and 4 x the SMs ran in 4 waves: docs/kernels.md, "all_reduce v6".)
// Blocks take their ranges in start order (LamportSetup): a concurrent kernel
// can hold SMs, and then not every block starts at once. Slots are addressed
// by vector index, not by block, so ranks need not agree on the grid.
constexpr size_t kLamportBytesPerBlock = 4 * 1024;
// all_reduce_rms_norm: LL8 lines of a row per block. A row of 8 KiB (4096
// bf16, 1024 lines) spreads over a cluster of 4 blocks, 16 KiB over 8; each
// thread handles one line, where the one-block-per-row kernel ran one block of
// 512 threads with 2-4 lines each in sequence (docs/kernels.md,
// "all_reduce_rms_norm").
constexpr size_t kNormLinesPerBlock = 256;
constexpr int kLamportBlocksPerSm = 2;
// The word a Lamport slot holds where no payload has arrived (runtime.cu fills
// the slots with 0xff bytes), and the NaN sent in its place.
constexpr uint32_t kLamportEmpty = 0xffffffffu;
constexpr uint32_t kLamportNaN = 0x7fffffffu;
// Where every sum starts: -0.0 is the identity of IEEE addition (-0 + x == x for every x),
// +0.0 is not (+0 + -0 == +0), so an element that is -0.0 on every rank sums to -0.0, as
// lax.psum's does.
constexpr float kSumIdentity = -0.0f;

// Phases index the receive slots; see runtime.h.
constexpr int kPhaseReduceScatter = 0;
constexpr int kPhaseInterNode = 1;
constexpr int kPhaseAllGather = 2;

struct HeapView {
  PeerMap peers;  // where peers' copies of this heap live (transport.cuh)
  uint64_t* flags;
  char* ll;
  char* lamport;
  char* data;
  float* acc[2];
  uint4* stage[2];
  size_t slot_bytes;
  size_t ll_slot_bytes;
  size_t lamport_slot_bytes;
  int num_pes;
  int ranks_per_node;  // Lamport slots are indexed by the sender's index on its node
};

struct Params {
  const void* in;
  void* out;
  size_t n;          // elements in this launch
  size_t per_block;  // elements (one-shot) or shard elements (RS/AG) per block; vector multiple
  size_t shard;      // RS/AG: elements per local shard (vector multiple)
  Topology topo;
  int my_pe;
  HeapView heap;
  uint64_t* pair_epochs;
  unsigned int* done_counter;  // [0] blocks finished, [1] blocks started (LamportSetup)
  DeviceError* error;
  OpId op;  // the op a device error names (all_reduce, its stages, all_reduce_rms_norm)
  uint64_t timeout_ns;
  bool force_put;  // inter-node steps use NVSHMEM puts even to load/store-reachable peers
  unsigned int poll_ns;  // measurement knob: Lamport polls back off this long after a miss
  bool epochs_at_start;  // measurement knob: the one-shot LL kernels advance epochs at the start
  Stage stage;     // the whole all-reduce, or only its intra-node reduce-scatter or all-gather
  float* shard_out;       // Stage::kReduceScatter: this rank's reduced shard, fp32 [shard]
  const float* shard_in;  // Stage::kAllGather: this rank's shard to gather, fp32 [shard]
  int bump[kMaxBump];  // peers whose pair epoch this call advances
  int num_bump;
};

// ---------------------------------------------------------------- helpers

__device__ __forceinline__ uint64_t* FlagAt(const HeapView& h, uint64_t epoch, int phase,
                                            int sender, int block) {
  const size_t parity = epoch & 1;
  return h.flags + ((parity * kNumPhases + phase) * h.num_pes + sender) * kMaxBlocks + block;
}

__device__ __forceinline__ char* DataAt(const HeapView& h, uint64_t epoch, int phase, int sender) {
  const size_t parity = epoch & 1;
  return h.data + ((parity * kNumPhases + phase) * h.num_pes + sender) * h.slot_bytes;
}

__device__ __forceinline__ uint4* LlAt(const HeapView& h, uint64_t epoch, int phase, int sender) {
  const size_t parity = epoch & 1;
  return reinterpret_cast<uint4*>(h.ll +
                                  ((parity * kNumPhases + phase) * h.num_pes + sender) * h.ll_slot_bytes);
}

__device__ __forceinline__ uint4* LamportAt(const HeapView& h, uint64_t epoch, int phase,
                                            int sender) {
  const size_t parity = epoch & 1;
  const size_t index = (parity * kNumLamportPhases + phase) * h.ranks_per_node +
                       sender % h.ranks_per_node;
  return reinterpret_cast<uint4*>(h.lamport + index * h.lamport_slot_bytes);
}

template <typename P>
__device__ __forceinline__ P* PeerPtr(const HeapView& h, P* symmetric, int pe) {
  return PeerAddress(h.peers, symmetric, pe);
}

__device__ __forceinline__ uint64_t EpochWith(const Params& p, int pe) {
  return p.pair_epochs[pe] + 1;
}

// This call's epoch with every other PE of the local group (its G =
// p.topo.local_size PEs), by local rank; the entry of this rank is left unset.
// Inlined with the loop unrolled, so the array stays in the caller's registers.
__device__ __forceinline__ void LocalGroupEpochs(const Params& p, int G,
                                                 uint64_t (&epoch)[kMaxGroupSize]) {
  const Topology& t = p.topo;
#pragma unroll
  for (int r = 0; r < kMaxGroupSize; ++r) {
    if (r < G && r != t.local_rank) epoch[r] = EpochWith(p, t.local_pes[r]);
  }
}

__device__ __forceinline__ void StoreRelease(uint64_t* addr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

// After every thread of the block wrote its payload to `pe`: make the writes
// visible system-wide, then raise the flag (thread 0 only).
__device__ __forceinline__ void SignalPeer(const HeapView& h, uint64_t* local_flag_symmetric,
                                           int pe, uint64_t epoch) {
  __threadfence_system();
  StoreRelease(PeerPtr(h, local_flag_symmetric, pe), epoch);
}

__device__ __forceinline__ void StoreLL(uint4* dst, uint2 data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(data.x),
               "r"(flag), "r"(data.y), "r"(flag)
               : "memory");
}

// Polls one LL8 line until both cells carry `flag`; traps after the timeout.
__device__ __forceinline__ uint2 LoadLL(const uint4* src, uint32_t flag, const Params& p,
                                        int peer_pe, int step) {
  uint32_t a, b, c, d;
  uint64_t start = 0;
  for (uint32_t spins = 0;; ++spins) {  // unsigned: wraps, where int would overflow
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "l"(src)
                 : "memory");
    if (b == flag && d == flag) return make_uint2(a, c);
    if ((spins & 1023) == 0) {
      const uint64_t now = GlobalTimerNs();
      if (start == 0) {
        start = now;
      } else if (now - start > p.timeout_ns) {
        ReportTimeoutAndTrap(p.error, p.op, p.topo.rank, peer_pe, step, flag,
                             b != flag ? b : d, /*block=*/-1, WaitKind::kLLFlag);
      }
    }
  }
}

// A vector to send under the Lamport protocol: a word equal to the empty
// pattern (a NaN in every dtype) becomes another NaN.
__device__ __forceinline__ uint4 LamportPayload(uint4 v) {
  v.x = v.x == kLamportEmpty ? kLamportNaN : v.x;
  v.y = v.y == kLamportEmpty ? kLamportNaN : v.y;
  v.z = v.z == kLamportEmpty ? kLamportNaN : v.z;
  v.w = v.w == kLamportEmpty ? kLamportNaN : v.w;
  return v;
}

// Polls one vector of a Lamport slot until every word has arrived (32-bit
// stores are single-copy atomic, so a word that is not empty is the payload);
// traps after the timeout, naming the range by its start ticket (LamportPeers).
__device__ __forceinline__ uint4 LoadLamport(const uint4* src, const Params& p, int peer_pe,
                                             uint64_t epoch, int step, size_t ticket) {
  uint4 v;
  uint64_t start = 0;
  for (uint32_t spins = 0;; ++spins) {  // unsigned: wraps, where int would overflow
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(src)
                 : "memory");
    if (v.x != kLamportEmpty && v.y != kLamportEmpty && v.z != kLamportEmpty &&
        v.w != kLamportEmpty) {
      return v;
    }
    if (p.poll_ns != 0) __nanosleep(p.poll_ns);  // measurement knob (LamportKnobs)
    if ((spins & 1023) == 0) {
      const uint64_t now = GlobalTimerNs();
      if (start == 0) {
        start = now;
      } else if (now - start > p.timeout_ns) {
        ReportTimeoutAndTrap(p.error, p.op, p.topo.rank, peer_pe, step, epoch, /*seen=*/0,
                             static_cast<int>(ticket), WaitKind::kLamportData);
      }
    }
  }
}

// Word <-> fp32 conversion: one 32-bit word holds 1 float or 2 halves.
template <typename T>
struct Words;
template <>
struct Words<float> {
  static constexpr int kPerWord = 1;
  __device__ static void ToFloat(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
  __device__ static uint32_t FromFloat(const float* f) { return __float_as_uint(f[0]); }
};
template <>
struct Words<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  __device__ static void ToFloat(uint32_t w, float* f) {
    f[0] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w & 0xffff)));
    f[1] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w >> 16)));
  }
  __device__ static uint32_t FromFloat(const float* f) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f[0]))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f[1]))) << 16);
  }
};
template <>
struct Words<__half> {
  static constexpr int kPerWord = 2;
  __device__ static void ToFloat(uint32_t w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffff)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  __device__ static uint32_t FromFloat(const float* f) {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(f[0]))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(f[1]))) << 16);
  }
};

// 16-byte vectors of T.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
  static constexpr int kPerWord = Words<T>::kPerWord;
  __device__ static void Add(uint4 v, float* acc) {
    float f[kElems];
    Words<T>::ToFloat(v.x, f);
    Words<T>::ToFloat(v.y, f + kPerWord);
    Words<T>::ToFloat(v.z, f + 2 * kPerWord);
    Words<T>::ToFloat(v.w, f + 3 * kPerWord);
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[i] += f[i];
  }
  __device__ static uint4 Pack(const float* f) {
    return make_uint4(Words<T>::FromFloat(f), Words<T>::FromFloat(f + kPerWord),
                      Words<T>::FromFloat(f + 2 * kPerWord), Words<T>::FromFloat(f + 3 * kPerWord));
  }
};

// The vector V (8 or 16 bytes) of T starting at element `first` (< n);
// elements past n read as 0.
template <typename V, typename T>
__device__ __forceinline__ V LoadPadded(const T* x, size_t first, size_t n) {
  constexpr size_t kElems = sizeof(V) / sizeof(T);
  if (first + kElems <= n) return *reinterpret_cast<const V*>(x + first);
  V v;
  T* tmp = reinterpret_cast<T*>(&v);
#pragma unroll
  for (size_t i = 0; i < kElems; ++i) tmp[i] = first + i < n ? x[first + i] : T(0.0f);
  return v;
}

// Stores the elements of `v` that fall before n, from element `first` on.
template <typename V, typename T>
__device__ __forceinline__ void StorePadded(T* y, size_t first, size_t n, V v) {
  constexpr size_t kElems = sizeof(V) / sizeof(T);
  if (first + kElems <= n) {
    *reinterpret_cast<V*>(y + first) = v;
    return;
  }
  const T* tmp = reinterpret_cast<const T*>(&v);
  for (size_t i = 0; first + i < n; ++i) y[first + i] = tmp[i];
}

// The LL flags' period end. An LL8 cell carries the low 32 bits of its call's
// pair epoch, so flags repeat every 2^32 calls: a cell written 2^32 calls
// earlier and not overwritten since (a message longer than every later one of
// that parity) would read as new. A slot of parity q (epoch & 1) only ever
// expects flags of parity q, so a cell stamped with a flag of the other parity
// can never match. The slots start stamped that way (runtime.cu), and the last
// call of each parity before the low 32 bits wrap (flags 0xFFFFFFFE and
// 0xFFFFFFFF) re-stamps every cell this PE receives from the peer in that
// parity, in every phase, once all of the call's blocks have read theirs
// (each block has used the values it loaded, summed or stored them, before
// Finish's barrier and ticket, so the re-stamp cannot change what they read).
// The peer's next store into that slot belongs to call e + 2, which it starts
// only after this PE's call e + 1 has sent, that is after this kernel ended
// (the two-parity argument at the top of this file; in the shard-based
// kernels a pair whose shards are empty in a call, within a node or across
// nodes, exchanges no cell, and the wait is then indirect, through the call's
// other exchanges). So the
// count may wrap: each new period starts with no cell of the slot's parity
// left from the last.
constexpr uint32_t kLastFlagsOfPeriod = 0xFFFFFFFEu;  // the calls that re-stamp

// Re-stamps this PE's LL cells of `epoch`'s parity from `sender` (the heap's
// LL region `ll`, laid out as LlAt reads it): 3 x ll_slot_bytes (up to 6 MiB)
// of 16-byte stores from the one thread that advances the epochs, once every
// 2^32 calls of the pair. Out of line and with scalar arguments, so that the
// kernels' common path keeps its registers (a reference to the kernel's
// parameters would copy them to the stack).
__device__ __noinline__ void RestampLLFromPeer(char* ll, size_t ll_slot_bytes, int num_pes,
                                               uint64_t epoch, int sender) {
  const uint32_t other = static_cast<uint32_t>(epoch & 1) ^ 1u;
  const uint4 stamp = make_uint4(0u, other, 0u, other);
  const size_t cells = ll_slot_bytes / sizeof(uint4);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const size_t slot = ((static_cast<size_t>(epoch & 1) * kNumPhases + phase) * num_pes + sender);
    uint4* cell = reinterpret_cast<uint4*>(ll + slot * ll_slot_bytes);
    for (size_t i = 0; i < cells; ++i) cell[i] = stamp;
  }
}

// Advances the pair epochs of this call, once every block has read them (one
// thread of the grid calls it), and at a period end of a pair's LL flags
// re-stamps that pair's cells (above). No fence: only the next kernels read
// the epochs and the cells, and the end of this kernel makes its writes
// visible to them. A fence here cost 0.1-0.3 us a call (docs/kernels.md, "The
// per-call bookkeeping").
__device__ __forceinline__ void AdvanceEpochs(const Params& p) {
  for (int i = 0; i < p.num_bump; ++i) {
    const uint64_t epoch = ++p.pair_epochs[p.bump[i]];  // this call's (EpochWith)
    if (static_cast<uint32_t>(epoch) >= kLastFlagsOfPeriod) {  // once every 2^32 calls
      RestampLLFromPeer(p.heap.ll, p.heap.ll_slot_bytes, p.heap.num_pes, epoch, p.bump[i]);
    }
  }
}

// The last block to finish advances the pair epochs of this call.
__device__ __forceinline__ void Finish(const Params& p, bool quiet) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (quiet) nvshmem_quiet();
    // No fence needed: every block read pair_epochs before its work, long
    // before its atomicAdd, and the last block writes them only after all adds.
    if (TookLastTicket(p.done_counter)) {
      AdvanceEpochs(p);
      p.done_counter[0] = 0;
      p.done_counter[1] = 0;  // every block took its ticket before it finished
    }
  }
}

// The alternative to Finish that the one-shot LL kernels (all_reduce's and
// all_reduce_rms_norm's) take under the measurement knob
// JAXOVERLAP_EPOCH_AT_START=1 (EpochKnob): the epochs are advanced at the
// start instead of the end, so that nothing is left to do after the last
// output store. Called by every thread after a barrier that follows all of
// the block's reads of the pair epochs: thread 0 takes a ticket with
// acquire-release order, so every read of the block happens before it; the
// last block to take one knows every block has read, and advances the epochs
// and resets the counter at once (done_counter[1] is the Lamport kernels'
// start ticket, which their own Finish resets; these kernels leave it alone).
// The epochs must be read nowhere else in the
// kernel (the one-shot simple, two-shot and stage kernels read them again
// later, so they keep Finish). Such a kernel cannot re-stamp the LL cells at
// the flags' period end (that needs every block's reads done), so there it
// stops the run instead: a rank traps before all its blocks have sent, and a
// peer may report a timeout instead. Prediction, from the parts measured on
// one GPU (docs/kernels.md, "The per-call bookkeeping"): at most 0.2-0.3 us
// less a call than the read + Finish (what Finish costs beyond the read, less
// the barrier this adds); not yet measured (scripts/gpu_check.sh epochab).
__device__ __forceinline__ void AdvanceEpochsAtStart(const Params& p) {
  if (threadIdx.x == 0) {
    unsigned int ticket;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(ticket)
                 : "l"(p.done_counter)
                 : "memory");
    if (ticket == gridDim.x - 1) {
      for (int i = 0; i < p.num_bump; ++i) {
        // The LL flags' period end needs a re-stamp after the call's reads
        // (AdvanceEpochs), which an advance at the start cannot do: under
        // the knob the run stops there instead.
        const uint64_t epoch = ++p.pair_epochs[p.bump[i]];
        if (static_cast<uint32_t>(epoch) >= kLastFlagsOfPeriod) {
          ReportEpochWrapAndTrap(p.error, p.op, p.topo.rank, p.bump[i], epoch);
        }
      }
      p.done_counter[0] = 0;
    }
  }
}

// The one-shot LL kernel's start under the knob: threads r < local_size read
// the call's pair epochs into `epochs` (shared), a barrier, then
// AdvanceEpochsAtStart.
__device__ __forceinline__ void StartEpochs(const Params& p, uint64_t* epochs) {
  const Topology& t = p.topo;
  const int r = threadIdx.x;
  if (r < t.local_size && r != t.local_rank) epochs[r] = EpochWith(p, t.local_pes[r]);
  __syncthreads();
  AdvanceEpochsAtStart(p);
}

// The per-peer state of a Lamport kernel, in shared memory, for peer r: the
// pair's epoch, r's PE, this rank's slot on r (to) and r's slot here (from),
// per phase; and the range this block works on. Held in registers, the state
// of up to kMaxGroupSize peers took the kernels to 128 registers a thread.
struct LamportPeers {
  uint64_t epoch[kMaxGroupSize];
  int pe[kMaxGroupSize];
  uint4* to[kNumLamportPhases][kMaxGroupSize];
  uint4* from[kNumLamportPhases][kMaxGroupSize];
  size_t block;
};

// Fills the block's LamportPeers (one thread per peer) behind one barrier.
// The block's range is numbered in the order in which blocks start (a ticket
// from an atomic counter), not by blockIdx: a block waits for the block of the
// peer that handles the same range, and where not every block of the grid can
// start at once (a concurrent kernel holds SMs), numbering ranges by start
// order means that every range below a waiting block's was taken by a block
// that already started, and every block sends before it waits, so the peer's
// waits always end, whatever order the hardware starts blocks in (CUDA does
// not promise blockIdx order). One atomic per block.
__device__ __forceinline__ void LamportSetup(const Params& p, LamportPeers* s) {
  const Topology& t = p.topo;
  const int r = threadIdx.x;
  if (r < t.local_size && r != t.local_rank) {
    const int pe = t.local_pes[r];
    const uint64_t epoch = EpochWith(p, pe);
    s->epoch[r] = epoch;
    s->pe[r] = pe;
#pragma unroll
    for (int phase = 0; phase < kNumLamportPhases; ++phase) {
      s->to[phase][r] = PeerPtr(p.heap, LamportAt(p.heap, epoch, phase, p.my_pe), pe);
      s->from[phase][r] = LamportAt(p.heap, epoch, phase, pe);
    }
  }
  if (threadIdx.x == 0) s->block = atomicAdd(p.done_counter + 1, 1u);
  __syncthreads();
}

// Elements of rank q's shard (two-shot and the RS/AG stages: shards of
// p.shard elements, the last one short or empty).
__device__ __forceinline__ size_t ShardLen(const Params& p, int q) {
  const size_t s = min(p.n, static_cast<size_t>(q) * p.shard);
  return min(p.n, s + p.shard) - s;
}

// Block `block`'s units [*b, *e) of a range of `len` elements, in units of
// `unit` elements (8-byte lines, 16-byte vectors), `per_block` units a block.
__device__ __forceinline__ void UnitRange(size_t len, size_t unit, size_t per_block, size_t block,
                                          size_t* b, size_t* e) {
  const size_t units = (len + unit - 1) / unit;
  *b = min(units, block * per_block);
  *e = min(units, *b + per_block);
}

// ---------------------------------------------------------------- one-shot

// One-shot, LL8 protocol: every thread pushes 8-byte lines of its input to
// every peer as LL8 cells (direct NVLink stores), then polls its own slots for
// the peers' lines and sums all ranks in rank order.
template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotLLKernel(Params p) {
  constexpr size_t kLineElems = 8 / sizeof(T);
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const size_t lines = (p.n + kLineElems - 1) / kLineElems;
  const size_t per_block = p.per_block / kLineElems;  // lines
  const size_t lb = min(lines, blockIdx.x * per_block);
  const size_t le = min(lines, lb + per_block);

  __shared__ uint64_t start_epochs[kMaxGroupSize];
  if (p.epochs_at_start) StartEpochs(p, start_epochs);
  uint64_t epoch[kMaxGroupSize];
  uint4* remote[kMaxGroupSize];
  const uint4* local[kMaxGroupSize];
#pragma unroll
  for (int r = 0; r < kMaxGroupSize; ++r) {
    if (r < t.local_size && r != t.local_rank) {
      const int pe = t.local_pes[r];
      epoch[r] = p.epochs_at_start ? start_epochs[r] : EpochWith(p, pe);
      remote[r] = PeerPtr(h, LlAt(h, epoch[r], kPhaseReduceScatter, p.my_pe), pe);
      local[r] = LlAt(h, epoch[r], kPhaseReduceScatter, pe);
    }
  }
  // All sends first, so that the NVLink latency is paid once per thread,
  // not once per line.
  for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
    const uint2 mine = LoadPadded<uint2>(in, l * kLineElems, p.n);
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < t.local_size && r != t.local_rank) {
        StoreLL(remote[r] + l, mine, static_cast<uint32_t>(epoch[r]));
      }
    }
  }
  for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
    const uint2 mine = LoadPadded<uint2>(in, l * kLineElems, p.n);
    float acc[kLineElems];
#pragma unroll
    for (int i = 0; i < kLineElems; ++i) acc[i] = kSumIdentity;
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r >= t.local_size) break;
      const uint2 v = r == t.local_rank
                          ? mine
                          : LoadLL(local[r] + l, static_cast<uint32_t>(epoch[r]), p,
                                   t.local_pes[r], /*step=*/0);
      float f[kLineElems];
      Words<T>::ToFloat(v.x, f);
      Words<T>::ToFloat(v.y, f + Words<T>::kPerWord);
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) acc[i] += f[i];
    }
    const uint2 res = make_uint2(Words<T>::FromFloat(acc), Words<T>::FromFloat(acc + Words<T>::kPerWord));
    StorePadded(out, l * kLineElems, p.n, res);
  }
  if (!p.epochs_at_start) Finish(p, /*quiet=*/false);
}

// One-shot, simple protocol: one 16-byte load of the input, one direct store
// per peer, one flag per (block, peer); then the rank-order sum.
template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotSimpleKernel(Params p) {
  constexpr int kVec = Vec16<T>::kElems;
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const size_t begin = min(p.n, blockIdx.x * p.per_block);
  const size_t end = min(p.n, begin + p.per_block);
  const size_t vb = begin / kVec, ve = end / kVec;  // begin is a vector multiple

  uint64_t epoch[kMaxGroupSize];
  char* remote[kMaxGroupSize];
#pragma unroll
  for (int r = 0; r < kMaxGroupSize; ++r) {
    if (r < t.local_size && r != t.local_rank) {
      epoch[r] = EpochWith(p, t.local_pes[r]);
      remote[r] =
          PeerPtr(h, DataAt(h, epoch[r], kPhaseReduceScatter, p.my_pe), t.local_pes[r]);
    }
  }
  for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
    const uint4 x = reinterpret_cast<const uint4*>(in)[v];
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < t.local_size && r != t.local_rank) reinterpret_cast<uint4*>(remote[r])[v] = x;
    }
  }
  for (size_t i = ve * kVec + threadIdx.x; i < end; i += blockDim.x) {
    const T x = in[i];
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < t.local_size && r != t.local_rank) reinterpret_cast<T*>(remote[r])[i] = x;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int r = 0; r < t.local_size; ++r) {
      if (r != t.local_rank) {
        SignalPeer(h, FlagAt(h, epoch[r], kPhaseReduceScatter, p.my_pe, blockIdx.x),
                   t.local_pes[r], epoch[r]);
      }
    }
  }
  if (threadIdx.x < t.local_size && threadIdx.x != t.local_rank) {
    const int r = threadIdx.x;
    const uint64_t e = EpochWith(p, t.local_pes[r]);
    WaitFlagOrTrap(FlagAt(h, e, kPhaseReduceScatter, t.local_pes[r], blockIdx.x), e, p.timeout_ns,
                   p.error, p.op, t.rank, t.local_pes[r], /*step=*/0);
  }
  __syncthreads();

  const T* src[kMaxGroupSize];
#pragma unroll
  for (int r = 0; r < kMaxGroupSize; ++r) {
    if (r < t.local_size) {
      src[r] = r == t.local_rank
                   ? in
                   : reinterpret_cast<const T*>(DataAt(h, epoch[r], kPhaseReduceScatter, t.local_pes[r]));
    }
  }
  for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = kSumIdentity;
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < t.local_size) Vec16<T>::Add(reinterpret_cast<const uint4*>(src[r])[v], acc);
    }
    reinterpret_cast<uint4*>(out)[v] = Vec16<T>::Pack(acc);
  }
  for (size_t i = ve * kVec + threadIdx.x; i < end; i += blockDim.x) {
    float acc = kSumIdentity;
    for (int r = 0; r < t.local_size; ++r) acc += ToFloat(src[r][i]);
    out[i] = FromFloat<T>(acc);
  }
  Finish(p, /*quiet=*/false);
}

// One-shot, Lamport protocol: every thread stores 16-byte vectors of its
// input into every peer's slot (plain NVLink stores: no fence, no flag), then
// polls its own slots for the peers' vectors, sums all ranks in rank order in
// fp32, and empties each slot vector it read. kMinBlocks: the 512-thread
// blocks an SM it is compiled for (the register cap; kLamportBlocksPerSm).
template <typename T, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) OneShotLamportKernel(Params p) {
  constexpr size_t kVec = Vec16<T>::kElems;
  __shared__ LamportPeers s;
  LamportSetup(p, &s);
  const int G = p.topo.local_size;
  const int me = p.topo.local_rank;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const size_t vecs = (p.n + kVec - 1) / kVec;
  const size_t per_block = p.per_block / kVec;  // vectors
  const size_t vb = min(vecs, s.block * per_block);
  const size_t ve = min(vecs, vb + per_block);

  for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
    const uint4 x = LamportPayload(LoadPadded<uint4>(in, v * kVec, p.n));
    for (int r = 0; r < G; ++r) {
      if (r != me) s.to[0][r][v] = x;
    }
  }
  const uint4 empty = make_uint4(kLamportEmpty, kLamportEmpty, kLamportEmpty, kLamportEmpty);
  for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = kSumIdentity;
    for (int r = 0; r < G; ++r) {
      if (r == me) {
        Vec16<T>::Add(LoadPadded<uint4>(in, v * kVec, p.n), acc);
      } else {
        uint4* slot = s.from[0][r] + v;
        Vec16<T>::Add(LoadLamport(slot, p, s.pe[r], s.epoch[r], /*step=*/0, s.block), acc);
        *slot = empty;
      }
    }
    StorePadded(out, v * kVec, p.n, Vec16<T>::Pack(acc));
  }
  Finish(p, /*quiet=*/false);
}

// ---------------------------------------------------------------- two-shot LL

// Two-shot within one node, LL8 protocol: the reduce-scatter and the
// all-gather each send 8-byte lines as LL8 cells (data and epoch together, so
// no flag round trip), and the reduced shard goes back out in T (rounded once,
// as in the simple two-shot). Block b owns the same line range of every
// rank's shard in both phases.
template <typename T>
__global__ void __launch_bounds__(kThreads) TwoShotLLKernel(Params p) {
  constexpr size_t kLineElems = 8 / sizeof(T);
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const int G = t.local_size;
  auto shard_len = [&](int q) { return ShardLen(p, q); };
  auto line_range = [&](size_t len, size_t* lb, size_t* le) {
    UnitRange(len, kLineElems, p.per_block / kLineElems, blockIdx.x, lb, le);
  };
  uint64_t epoch[kMaxGroupSize];
  LocalGroupEpochs(p, G, epoch);

  // Reduce-scatter: every peer's shard to that peer, as LL8 cells.
#pragma unroll
  for (int q = 0; q < kMaxGroupSize; ++q) {
    if (q >= G || q == t.local_rank) continue;
    const size_t len = shard_len(q);
    size_t lb, le;
    line_range(len, &lb, &le);
    const T* src = in + static_cast<size_t>(q) * p.shard;
    uint4* dst = PeerPtr(h, LlAt(h, epoch[q], kPhaseReduceScatter, p.my_pe), t.local_pes[q]);
    const uint32_t flag = static_cast<uint32_t>(epoch[q]);
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      StoreLL(dst + l, LoadPadded<uint2>(src, l * kLineElems, len), flag);
    }
  }
  // Sum my shard in rank order; the result goes to my output and, as LL8
  // cells, to every peer's all-gather slot.
  {
    const size_t len = shard_len(t.local_rank);
    size_t lb, le;
    line_range(len, &lb, &le);
    const size_t my_off = static_cast<size_t>(t.local_rank) * p.shard;
    uint4* remote[kMaxGroupSize];
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < G && r != t.local_rank) {
        remote[r] = PeerPtr(h, LlAt(h, epoch[r], kPhaseAllGather, p.my_pe), t.local_pes[r]);
      }
    }
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      const uint2 mine = LoadPadded<uint2>(in + my_off, l * kLineElems, len);
      float acc[kLineElems];
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) acc[i] = kSumIdentity;
#pragma unroll
      for (int r = 0; r < kMaxGroupSize; ++r) {
        if (r >= G) break;
        const uint2 v = r == t.local_rank
                            ? mine
                            : LoadLL(LlAt(h, epoch[r], kPhaseReduceScatter, t.local_pes[r]) + l,
                                     static_cast<uint32_t>(epoch[r]), p, t.local_pes[r],
                                     /*step=*/0);
        float f[kLineElems];
        Words<T>::ToFloat(v.x, f);
        Words<T>::ToFloat(v.y, f + Words<T>::kPerWord);
#pragma unroll
        for (int i = 0; i < kLineElems; ++i) acc[i] += f[i];
      }
      const uint2 res =
          make_uint2(Words<T>::FromFloat(acc), Words<T>::FromFloat(acc + Words<T>::kPerWord));
#pragma unroll
      for (int r = 0; r < kMaxGroupSize; ++r) {
        if (r < G && r != t.local_rank) StoreLL(remote[r] + l, res, static_cast<uint32_t>(epoch[r]));
      }
      StorePadded(out + my_off, l * kLineElems, len, res);
    }
  }
  // All-gather: the peers' reduced shards from my slots.
#pragma unroll
  for (int q = 0; q < kMaxGroupSize; ++q) {
    if (q >= G || q == t.local_rank) continue;
    const size_t len = shard_len(q);
    size_t lb, le;
    line_range(len, &lb, &le);
    const uint4* cells = LlAt(h, epoch[q], kPhaseAllGather, t.local_pes[q]);
    T* dst = out + static_cast<size_t>(q) * p.shard;
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      StorePadded(dst, l * kLineElems, len,
                LoadLL(cells + l, static_cast<uint32_t>(epoch[q]), p, t.local_pes[q], /*step=*/99));
    }
  }
  Finish(p, /*quiet=*/false);
}

// ---------------------------------------------------------- two-shot Lamport

// Two-shot within one node, Lamport protocol: the reduce-scatter stores each
// peer's shard as plain vectors into its phase-0 slot; each rank polls its
// shard's vectors from every peer, sums them in rank order in fp32, empties
// what it read, and stores the sum (rounded once to T) to its output and into
// every peer's phase-1 slot; the all-gather polls the peers' sums from the
// phase-1 slots and empties them. Slot offsets are vector indices within a
// shard. The block with ticket b owns the same vector range of every shard in
// every phase.
template <typename T, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) TwoShotLamportKernel(Params p) {
  constexpr size_t kVec = Vec16<T>::kElems;
  __shared__ LamportPeers s;
  LamportSetup(p, &s);
  const int G = p.topo.local_size;
  const int me = p.topo.local_rank;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const size_t per_block = p.per_block / kVec;  // vectors of a shard
  auto vector_range = [&](size_t len, size_t* vb, size_t* ve) {
    UnitRange(len, kVec, per_block, s.block, vb, ve);
  };
  const uint4 empty = make_uint4(kLamportEmpty, kLamportEmpty, kLamportEmpty, kLamportEmpty);

  // Reduce-scatter: every peer's shard to that peer.
  for (int q = 0; q < G; ++q) {
    if (q == me) continue;
    const size_t len = ShardLen(p, q);
    size_t vb, ve;
    vector_range(len, &vb, &ve);
    const T* src = in + static_cast<size_t>(q) * p.shard;
    uint4* dst = s.to[0][q];
    for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
      dst[v] = LamportPayload(LoadPadded<uint4>(src, v * kVec, len));
    }
  }
  // My shard: sum the ranks, keep it, and send it to every peer.
  {
    const size_t len = ShardLen(p, me);
    size_t vb, ve;
    vector_range(len, &vb, &ve);
    const size_t my_off = static_cast<size_t>(me) * p.shard;
    for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
      float acc[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = kSumIdentity;
      for (int r = 0; r < G; ++r) {
        if (r == me) {
          Vec16<T>::Add(LoadPadded<uint4>(in + my_off, v * kVec, len), acc);
        } else {
          uint4* slot = s.from[0][r] + v;
          Vec16<T>::Add(LoadLamport(slot, p, s.pe[r], s.epoch[r], /*step=*/0, s.block), acc);
          *slot = empty;
        }
      }
      const uint4 sum = Vec16<T>::Pack(acc);
      const uint4 payload = LamportPayload(sum);
      for (int r = 0; r < G; ++r) {
        if (r != me) s.to[1][r][v] = payload;
      }
      StorePadded(out + my_off, v * kVec, len, sum);
    }
  }
  // All-gather: the peers' sums from my phase-1 slots.
  for (int q = 0; q < G; ++q) {
    if (q == me) continue;
    const size_t len = ShardLen(p, q);
    size_t vb, ve;
    vector_range(len, &vb, &ve);
    T* dst = out + static_cast<size_t>(q) * p.shard;
    for (size_t v = vb + threadIdx.x; v < ve; v += blockDim.x) {
      uint4* slot = s.from[1][q] + v;
      StorePadded(dst, v * kVec, len,
                  LoadLamport(slot, p, s.pe[q], s.epoch[q], /*step=*/1, s.block));
      *slot = empty;
    }
  }
  Finish(p, /*quiet=*/false);
}

// ------------------------------------------- one-shot + residual + RMSNorm

// The fused all-reduce + residual add + RMSNorm of one launch (AllReduceRmsNorm).
struct NormParams {
  Params base;           // in: p, out: h, n: rows * hidden; the one-shot LL protocol's state
  const void* residual;  // [rows, hidden]
  const void* weight;    // [hidden]
  void* y;               // [rows, hidden]
  size_t rows;
  size_t hidden;
  size_t row_lines;  // 8-byte lines per row (hidden * sizeof(T) / 8, exact)
  float eps;
};

// Thread block clusters exist from sm_90 (Hopper). Below it the norm kernel
// runs with a "cluster" of one block: these are then the block's own rank,
// barrier and shared memory, and the launch never asks for more.
__device__ __forceinline__ unsigned int ClusterBlocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cg::this_cluster().num_blocks();
#else
  return 1;
#endif
}

__device__ __forceinline__ unsigned int ClusterRank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cg::this_cluster().block_rank();
#else
  return 0;
#endif
}

__device__ __forceinline__ void ClusterSync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// The two halves of a cluster barrier, for a wait placed later than the
// arrival: every block of the cluster must have started before any block
// touches another's shared memory (CUDA programming guide, distributed shared
// memory). Relaxed: the arrival orders no memory access.
__device__ __forceinline__ void ClusterArriveRelaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
}

__device__ __forceinline__ void ClusterWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait;" ::: "memory");
#endif
}

// Stores `v` at `*local` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ void ClusterWrite(float* local, unsigned int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  *cg::this_cluster().map_shared_rank(local, rank) = v;
#else
  *local = v;
#endif
}

// One-shot LL all-reduce with the norm in its epilogue. A row belongs to a
// thread block cluster of C blocks (the launch's cluster size, 1-8), each
// block a contiguous 1/C of the row's lines, so that a row of 8 or 16 KiB
// spreads over several SMs. Every thread first pushes its lines of its
// cluster's rows to every peer (as OneShotLLKernel); then, row by row, it
// loads the residual and the weight, sums the ranks' lines in rank order in
// fp32, adds the residual, rounds h to T and stores it, and accumulates the
// square of the rounded h. Warp shuffles give each warp's part of the row's
// sum of squares, which lane 0 stores into every block of the cluster
// (distributed shared memory) at the slot of its (block, warp); after one
// cluster barrier every thread adds the cluster's parts from its own block's
// shared memory in slot order, so every block gets the same scale. Each
// thread takes the h lines it stored itself (the first from registers, any
// others re-read; no barrier needed for those) and writes
// y = h * rsqrt(sum / hidden + eps) * weight. The parts are double-buffered
// by row parity: a block stores into a slot again two rows later, after the
// next row's cluster barrier, which every reader of the slot reaches only
// after reading it. No block's shared memory is written after the last
// barrier (the blocks of a cluster share their rows), so none waits for the
// others before it leaves.
//
// Slots are addressed by line index, not by block, so ranks need not agree
// on the grid; every block sends before it waits, and the launch keeps the
// grid within what the GPU holds at once (NormClustersAtOnce).
template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotLLRmsNormKernel(NormParams np) {
  constexpr int kLineElems = 8 / sizeof(T);
  constexpr int kPerWord = Words<T>::kPerWord;
  const Params& p = np.base;
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const uint2* in = static_cast<const uint2*>(p.in);
  const uint2* res = static_cast<const uint2*>(np.residual);
  const uint2* wgt = static_cast<const uint2*>(np.weight);
  uint2* hout = static_cast<uint2*>(p.out);
  uint2* yout = static_cast<uint2*>(np.y);
  const size_t L = np.row_lines;
  const unsigned int parts = ClusterBlocks();
  const unsigned int part = ClusterRank();
  const size_t first_row = blockIdx.x / parts;
  const size_t row_stride = gridDim.x / parts;
  const size_t lb = L * part / parts;  // this block's lines [lb, le) of every row
  const size_t le = L * (part + 1) / parts;

  // The per-peer state in shared memory, filled by one thread per peer (in
  // registers, next to a row's values, it took the kernel past 128 registers).
  __shared__ uint32_t flag[kMaxGroupSize];  // the pair epoch, as LL8 cells carry it
  __shared__ uint4* remote[kMaxGroupSize];
  __shared__ const uint4* local[kMaxGroupSize];
  if (const int r = threadIdx.x; r < t.local_size && r != t.local_rank) {
    const int pe = t.local_pes[r];
    const uint64_t epoch = EpochWith(p, pe);
    flag[r] = static_cast<uint32_t>(epoch);
    remote[r] = PeerPtr(h, LlAt(h, epoch, kPhaseReduceScatter, p.my_pe), pe);
    local[r] = LlAt(h, epoch, kPhaseReduceScatter, pe);
  }
  __syncthreads();
  if (p.epochs_at_start) AdvanceEpochsAtStart(p);  // the knob (EpochKnob)
  ClusterArriveRelaxed();  // this block has started; waited for before the first ClusterWrite
  for (size_t row = first_row; row < np.rows; row += row_stride) {
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      const size_t g = row * L + l;
      const uint2 mine = in[g];
#pragma unroll
      for (int r = 0; r < kMaxGroupSize; ++r) {
        if (r < t.local_size && r != t.local_rank) {
          StoreLL(remote[r] + g, mine, flag[r]);
        }
      }
    }
  }

  // Every warp's part of a row's sum of squares, by row parity, at slot
  // (cluster rank) * warps + warp: written by the cluster's blocks.
  __shared__ float warp_parts[2][kMaxNormCluster * (kThreads / 32)];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_warps = (blockDim.x + 31) / 32;
  // A thread's first line of every row (with the grid's split, usually its
  // only one): its weight is loaded once, before any wait, and its h is kept
  // in registers for the epilogue, so that after the row's barriers the
  // thread touches memory only to store y.
  const size_t first = lb + threadIdx.x;
  const uint2 first_w = first < le ? wgt[first] : make_uint2(0u, 0u);
  uint2 first_h = make_uint2(0u, 0u);
  int parity = 0;
  for (size_t row = first_row; row < np.rows; row += row_stride, parity ^= 1) {
    float sumsq = 0.0f;
    for (size_t l = first; l < le; l += blockDim.x) {
      const size_t g = row * L + l;
      const uint2 rv = res[g];  // loaded before the poll, so its latency hides behind it
      float acc[kLineElems];
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) acc[i] = kSumIdentity;
      float f[kLineElems];
#pragma unroll
      for (int r = 0; r < kMaxGroupSize; ++r) {
        if (r >= t.local_size) break;
        const uint2 v = r == t.local_rank
                            ? in[g]
                            : LoadLL(local[r] + g, flag[r], p,
                                     t.local_pes[r], /*step=*/0);
        Words<T>::ToFloat(v.x, f);
        Words<T>::ToFloat(v.y, f + kPerWord);
#pragma unroll
        for (int i = 0; i < kLineElems; ++i) acc[i] += f[i];
      }
      Words<T>::ToFloat(rv.x, f);
      Words<T>::ToFloat(rv.y, f + kPerWord);
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) acc[i] += f[i];
      const uint2 hv = make_uint2(Words<T>::FromFloat(acc), Words<T>::FromFloat(acc + kPerWord));
      hout[g] = hv;
      if (l == first) first_h = hv;
      // The norm sees h as stored (rounded to T), like the unfused expression.
      Words<T>::ToFloat(hv.x, f);
      Words<T>::ToFloat(hv.y, f + kPerWord);
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) sumsq += f[i] * f[i];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      sumsq += __shfl_xor_sync(0xffffffffu, sumsq, offset);
    }
    const unsigned int slots = parts * static_cast<unsigned int>(num_warps);
    if (row == first_row) ClusterWait();  // every block of the cluster has started
    if (lane == 0) {
      const unsigned int slot = part * static_cast<unsigned int>(num_warps) + warp;
      for (unsigned int k = 0; k < parts; ++k) ClusterWrite(&warp_parts[parity][slot], k, sumsq);
    }
    ClusterSync();  // every warp's part is in every block's shared memory
    // Every warp adds the same slots in the same order (lane-strided, then the
    // same butterfly), so every thread of the cluster gets the same total.
    float total = 0.0f;
    for (unsigned int k = lane; k < slots; k += 32) total += warp_parts[parity][k];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    }
    const float scale = rsqrtf(total / static_cast<float>(np.hidden) + np.eps);
    for (size_t l = first; l < le; l += blockDim.x) {
      const size_t g = row * L + l;
      const uint2 hv = l == first ? first_h : hout[g];  // stored by this thread above
      const uint2 wv = l == first ? first_w : wgt[l];
      float f[kLineElems], w[kLineElems];
      Words<T>::ToFloat(hv.x, f);
      Words<T>::ToFloat(hv.y, f + kPerWord);
      Words<T>::ToFloat(wv.x, w);
      Words<T>::ToFloat(wv.y, w + kPerWord);
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) f[i] = f[i] * scale * w[i];
      yout[g] = make_uint2(Words<T>::FromFloat(f), Words<T>::FromFloat(f + kPerWord));
    }
  }
  if (p.epochs_at_start) return;  // the knob advanced them at the start
  if (gridDim.x == parts) {
    // One cluster (a single row, as in decode at batch 1): every block read
    // the epochs before the last row's cluster barrier, which they all passed,
    // so its block 0 advances them without Finish's ticket, a global atomic
    // round trip (docs/kernels.md, "all_reduce_rms_norm").
    if (part == 0 && threadIdx.x == 0) AdvanceEpochs(p);
  } else {
    Finish(p, /*quiet=*/false);
  }
}

// -------------------------------------------------- reduce-scatter/all-gather

// Puts `count` fp32 values acc[off, off+count) into `pe`'s inter-node slot for
// this sender. A peer this GPU can reach by load/store (NVLink, the same
// node) gets direct stores from every thread; any other peer gets NVSHMEM
// puts from the symmetric heap: LL8 lines packed in a staging buffer and one
// bulk put, or a bulk put followed by the block's flag (put-with-signal).
// Returns whether an NVSHMEM put was issued (then a quiet must precede reuse
// of its source buffer).
template <bool kLL>
__device__ bool InterNodeSend(const Params& p, const float* acc, size_t off, size_t count, int pe,
                              int stage_index) {
  const HeapView& h = p.heap;
  const uint64_t e = EpochWith(p, pe);
  if constexpr (kLL) {
    const uint32_t flag = static_cast<uint32_t>(e);
    const size_t lb = off / 2, le = (off + count + 1) / 2;
    uint4* direct =
        p.force_put ? nullptr : PeerPtr(h, LlAt(h, e, kPhaseInterNode, p.my_pe), pe);
    if (direct != nullptr) {
      for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
        const size_t i = 2 * l;
        const float v1 = i + 1 < off + count ? acc[i + 1] : 0.0f;
        StoreLL(direct + l, make_uint2(__float_as_uint(acc[i]), __float_as_uint(v1)), flag);
      }
      return false;
    }
    uint4* stage = h.stage[stage_index];
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      const size_t i = 2 * l;
      const float v1 = i + 1 < off + count ? acc[i + 1] : 0.0f;
      stage[l] = make_uint4(__float_as_uint(acc[i]), flag, __float_as_uint(v1), flag);
    }
    __syncthreads();
    if (le > lb) {
      nvshmemx_putmem_nbi_block(LlAt(h, e, kPhaseInterNode, p.my_pe) + lb, stage + lb,
                                (le - lb) * sizeof(uint4), pe);
    }
    return true;
  } else {
    uint64_t* flag = FlagAt(h, e, kPhaseInterNode, p.my_pe, blockIdx.x);
    char* dst = DataAt(h, e, kPhaseInterNode, p.my_pe) + off * sizeof(float);
    float* direct = p.force_put ? nullptr : PeerPtr(h, reinterpret_cast<float*>(dst), pe);
    if (direct != nullptr) {
      const size_t vecs = count / 4;  // off is a multiple of 4 floats (16 B)
      for (size_t v = threadIdx.x; v < vecs; v += blockDim.x) {
        reinterpret_cast<uint4*>(direct)[v] = reinterpret_cast<const uint4*>(acc + off)[v];
      }
      for (size_t i = vecs * 4 + threadIdx.x; i < count; i += blockDim.x) direct[i] = acc[off + i];
      __syncthreads();
      if (threadIdx.x == 0) SignalPeer(h, flag, pe, e);
      return false;
    }
    if (count > 0) {
      nvshmemx_putmem_signal_nbi_block(dst, acc + off, count * sizeof(float), flag, e,
                                       NVSHMEM_SIGNAL_SET, pe);
    } else if (threadIdx.x == 0) {
      nvshmemx_signal_op(flag, e, NVSHMEM_SIGNAL_SET, pe);
    }
    return true;
  }
}

// Waits for `pe`'s values for [off, off+count) and returns this PE's receive
// slot for that sender (index it with the same offsets as acc).
template <bool kLL>
__device__ const float* InterNodeRecv(const Params& p, size_t off, size_t count, int pe, int step) {
  const HeapView& h = p.heap;
  const uint64_t e = EpochWith(p, pe);
  float* slot = reinterpret_cast<float*>(DataAt(h, e, kPhaseInterNode, pe));
  if constexpr (kLL) {
    // Decoded values go to this sender's simple slot, used as scratch here.
    const uint32_t flag = static_cast<uint32_t>(e);
    const uint4* cells = LlAt(h, e, kPhaseInterNode, pe);
    const size_t lb = off / 2, le = (off + count + 1) / 2;
    for (size_t l = lb + threadIdx.x; l < le; l += blockDim.x) {
      const uint2 v = LoadLL(cells + l, flag, p, pe, step);
      slot[2 * l] = __uint_as_float(v.x);
      slot[2 * l + 1] = __uint_as_float(v.y);
    }
  } else if (threadIdx.x == 0) {
    WaitFlagOrTrap(FlagAt(h, e, kPhaseInterNode, pe, blockIdx.x), e, p.timeout_ns, p.error,
                   p.op, p.topo.rank, pe, step);
  }
  __syncthreads();
  return slot;
}

// Reduce-scatter within the node, recursive doubling across nodes (with the
// MPICH fold for a node count that is not a power of two), all-gather within
// the node. With one node this is the two-shot algorithm. Partial sums cross
// nodes in fp32. The whole all-reduce with the LL protocol runs
// HierarchicalLLKernel (below) instead, unless JAXOVERLAP_HIERARCHICAL_LL=v3
// picks this one (an A/B knob). Stage::kReduceScatter runs only the first
// phase and writes the fp32 shard out of the call; Stage::kAllGather only the
// last, from an fp32 shard given to the call (the caller reduces across nodes
// in between).
template <typename T, bool kLL>
__global__ void __launch_bounds__(kThreads) ReduceScatterAllGatherKernel(Params p) {
  constexpr int kVec = Vec16<T>::kElems;
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const int G = t.local_size;

  auto shard_len = [&](int q) { return ShardLen(p, q); };
  const size_t my_len = shard_len(t.local_rank);
  const size_t ob = min(my_len, blockIdx.x * p.per_block);  // this block's range in my shard
  const size_t oe = min(my_len, ob + p.per_block);
  float* acc[2] = {h.acc[0], h.acc[1]};

  // Phase 0: reduce-scatter within the node into acc[0] (fp32).
  uint64_t epoch[kMaxGroupSize];
  LocalGroupEpochs(p, G, epoch);
  if (G > 1 && p.stage != Stage::kAllGather) {
#pragma unroll
    for (int q = 0; q < kMaxGroupSize; ++q) {
      if (q >= G || q == t.local_rank) continue;
      const size_t len = shard_len(q);
      const size_t qb = min(len, blockIdx.x * p.per_block), qe = min(len, qb + p.per_block);
      const T* src = in + static_cast<size_t>(q) * p.shard;
      T* dst = reinterpret_cast<T*>(
          PeerPtr(h, DataAt(h, epoch[q], kPhaseReduceScatter, p.my_pe), t.local_pes[q]));
      for (size_t v = qb / kVec + threadIdx.x; v < qe / kVec; v += blockDim.x) {
        reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
      }
      for (size_t i = (qe / kVec) * kVec + threadIdx.x; i < qe; i += blockDim.x) dst[i] = src[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int q = 0; q < G; ++q) {
        if (q != t.local_rank) {
          SignalPeer(h, FlagAt(h, epoch[q], kPhaseReduceScatter, p.my_pe, blockIdx.x),
                     t.local_pes[q], epoch[q]);
        }
      }
    }
    if (threadIdx.x < G && threadIdx.x != t.local_rank) {
      const int r = threadIdx.x;
      const uint64_t e = EpochWith(p, t.local_pes[r]);
      WaitFlagOrTrap(FlagAt(h, e, kPhaseReduceScatter, t.local_pes[r], blockIdx.x), e, p.timeout_ns,
                     p.error, p.op, t.rank, t.local_pes[r], /*step=*/0);
    }
    __syncthreads();
  }
  if (p.stage != Stage::kAllGather) {
    // The reduced shard goes to acc[0], or out of the call (Stage::kReduceScatter).
    float* sum = p.stage == Stage::kReduceScatter ? p.shard_out : acc[0];
    const T* mine = in + static_cast<size_t>(t.local_rank) * p.shard;
    const T* src[kMaxGroupSize];
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < G) {
        src[r] = r == t.local_rank ? mine
                                   : reinterpret_cast<const T*>(
                                         DataAt(h, epoch[r], kPhaseReduceScatter, t.local_pes[r]));
      }
    }
    for (size_t v = ob / kVec + threadIdx.x; v < oe / kVec; v += blockDim.x) {
      float a[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) a[i] = kSumIdentity;
#pragma unroll
      for (int r = 0; r < kMaxGroupSize; ++r) {
        if (r < G) Vec16<T>::Add(reinterpret_cast<const uint4*>(src[r])[v], a);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum[v * kVec + i] = a[i];
    }
    for (size_t i = (oe / kVec) * kVec + threadIdx.x; i < oe; i += blockDim.x) {
      float a = kSumIdentity;
      for (int r = 0; r < G; ++r) a += ToFloat(src[r][i]);
      sum[i] = a;
    }
    if (p.stage == Stage::kReduceScatter) {
      // The last rank's shard may be shorter than the buffer: zeros past it,
      // so that the caller's reduction of whole shards stays exact.
      const size_t pb = min(p.shard, blockIdx.x * p.per_block);
      const size_t pend = min(p.shard, pb + p.per_block);
      for (size_t i = max(pb, my_len) + threadIdx.x; i < pend; i += blockDim.x) sum[i] = 0.0f;
    }
    __syncthreads();
  }
  if (p.stage == Stage::kReduceScatter) {
    Finish(p, /*quiet=*/false);
    return;
  }

  // Phase 1: recursive doubling among the nodes (same local rank), with the
  // MPICH fold: node pow2 + i hands its partial sum to node i before the
  // doubling and gets the result back after it (one-directional steps).
  int cur = 0;
  bool used_put = false;  // an NVSHMEM put (not a direct store) was issued
  if (t.num_nodes > 1 && p.stage == Stage::kAll) {
    int pow2 = 1;
    while (pow2 * 2 <= t.num_nodes) pow2 *= 2;
    int step = 1;  // step numbers in timeout reports (0: reduce-scatter, 99: all-gather)
    int stage_index = 0;
    // acc[cur ^ 1] = acc[cur] + recv, once the put that last read acc[cur ^ 1]
    // (two steps ago) has completed.
    auto add_into_next = [&](const float* recv, bool add) {
      if (used_put && threadIdx.x == 0) nvshmem_quiet();
      __syncthreads();
      for (size_t i = ob + threadIdx.x; i < oe; i += blockDim.x) {
        acc[cur ^ 1][i] = add ? acc[cur][i] + recv[i] : recv[i];
      }
      __syncthreads();
      cur ^= 1;
    };
    if (t.node >= pow2) {
      const int partner = t.node_pes[t.node - pow2];
      used_put |= InterNodeSend<kLL>(p, acc[cur], ob, oe - ob, partner, stage_index);
      add_into_next(InterNodeRecv<kLL>(p, ob, oe - ob, partner, step), /*add=*/false);
    } else {
      const bool has_extra = t.node + pow2 < t.num_nodes;
      if (has_extra) {
        add_into_next(InterNodeRecv<kLL>(p, ob, oe - ob, t.node_pes[t.node + pow2], step++), true);
      }
      for (int mask = 1; mask < pow2; mask <<= 1) {
        const int partner = t.node_pes[t.node ^ mask];
        used_put |= InterNodeSend<kLL>(p, acc[cur], ob, oe - ob, partner, stage_index);
        stage_index ^= 1;
        // fp32 addition commutes, so both partners hold identical bits.
        add_into_next(InterNodeRecv<kLL>(p, ob, oe - ob, partner, step++), true);
      }
      if (has_extra) {
        used_put |= InterNodeSend<kLL>(p, acc[cur], ob, oe - ob, t.node_pes[t.node + pow2],
                                       stage_index);
      }
    }
  }

  // Phase 2: all-gather within the node, in T.
  const float* gathered = p.stage == Stage::kAllGather ? p.shard_in : acc[cur];
  const size_t my_off = static_cast<size_t>(t.local_rank) * p.shard;
  char* remote[kMaxGroupSize];
#pragma unroll
  for (int r = 0; r < kMaxGroupSize; ++r) {
    if (r < G && r != t.local_rank) {
      remote[r] = PeerPtr(h, DataAt(h, epoch[r], kPhaseAllGather, p.my_pe), t.local_pes[r]);
    }
  }
  for (size_t v = ob / kVec + threadIdx.x; v < oe / kVec; v += blockDim.x) {
    const uint4 x = Vec16<T>::Pack(gathered + v * kVec);
    reinterpret_cast<uint4*>(out + my_off)[v] = x;
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < G && r != t.local_rank) reinterpret_cast<uint4*>(remote[r])[v] = x;
    }
  }
  for (size_t i = (oe / kVec) * kVec + threadIdx.x; i < oe; i += blockDim.x) {
    const T x = FromFloat<T>(gathered[i]);
    out[my_off + i] = x;
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < G && r != t.local_rank) reinterpret_cast<T*>(remote[r])[i] = x;
    }
  }
  if (G > 1) {
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int r = 0; r < G; ++r) {
        if (r != t.local_rank) {
          SignalPeer(h, FlagAt(h, epoch[r], kPhaseAllGather, p.my_pe, blockIdx.x),
                     t.local_pes[r], epoch[r]);
        }
      }
    }
    if (threadIdx.x < G && threadIdx.x != t.local_rank) {
      const int r = threadIdx.x;
      const uint64_t e = EpochWith(p, t.local_pes[r]);
      WaitFlagOrTrap(FlagAt(h, e, kPhaseAllGather, t.local_pes[r], blockIdx.x), e, p.timeout_ns,
                     p.error, p.op, t.rank, t.local_pes[r], /*step=*/99);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r >= G || r == t.local_rank) continue;
      const size_t len = shard_len(r);
      const size_t rb = min(len, blockIdx.x * p.per_block), re = min(len, rb + p.per_block);
      const T* src = reinterpret_cast<const T*>(DataAt(h, epoch[r], kPhaseAllGather, t.local_pes[r]));
      T* dst = out + static_cast<size_t>(r) * p.shard;
      for (size_t v = rb / kVec + threadIdx.x; v < re / kVec; v += blockDim.x) {
        reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
      }
      for (size_t i = (re / kVec) * kVec + threadIdx.x; i < re; i += blockDim.x) dst[i] = src[i];
    }
  }
  Finish(p, /*quiet=*/used_put);
}

// ------------------------------------------------------- hierarchical LL (v4)

// This thread's partial (the kLineElems fp32 values of its shard line `l`, in
// `acc`; nothing where !has) to inter-node partner `pe`, as LL8 cells: line l
// is cells [l * kCells, (l + 1) * kCells), two floats a cell, the layout of
// InterNodeSend<true>. A load/store-reachable partner gets direct stores from
// each thread; any other partner one bulk put of the block's cells [cb, ce)
// from staging buffer `stage_index`, after a barrier (every thread of the
// block calls this, `has` or not). A put may still read its buffer until a
// quiet: `busy` marks the buffers of puts not yet quieted, and a busy buffer
// is quieted before it is rewritten (with two buffers in turn, from the third
// put on; v3 quieted after every step). `*used_put`: an NVSHMEM put was issued
// (Finish quiets at the end).
template <int kCells>
__device__ void SendPartialLL(const Params& p, const float* acc, size_t l, bool has, size_t cb,
                              size_t ce, int pe, int stage_index, bool busy[2], bool* used_put) {
  const HeapView& h = p.heap;
  const uint64_t e = EpochWith(p, pe);
  const uint32_t flag = static_cast<uint32_t>(e);
  uint4* slot = LlAt(h, e, kPhaseInterNode, p.my_pe);
  uint4* direct = p.force_put ? nullptr : PeerPtr(h, slot, pe);
  if (direct != nullptr) {
    if (has) {
#pragma unroll
      for (int c = 0; c < kCells; ++c) {
        StoreLL(direct + l * kCells + c,
                make_uint2(__float_as_uint(acc[2 * c]), __float_as_uint(acc[2 * c + 1])), flag);
      }
    }
    return;
  }
  if (busy[stage_index]) {  // the put that last read this staging buffer must have completed
    if (threadIdx.x == 0) nvshmem_quiet();
    __syncthreads();
    busy[0] = busy[1] = false;
  }
  uint4* stage = h.stage[stage_index];
  if (has) {
#pragma unroll
    for (int c = 0; c < kCells; ++c) {
      stage[l * kCells + c] = make_uint4(__float_as_uint(acc[2 * c]), flag,
                                         __float_as_uint(acc[2 * c + 1]), flag);
    }
  }
  __syncthreads();
  if (ce > cb) nvshmemx_putmem_nbi_block(slot + cb, stage + cb, (ce - cb) * sizeof(uint4), pe);
  busy[stage_index] = true;
  *used_put = true;
}

// Partner `pe`'s partial of this thread's line `l` (LL8 cells in this PE's
// inter-node slot for that sender), added into `acc`, or replacing it.
template <int kCells>
__device__ void RecvPartialLL(const Params& p, float* acc, size_t l, int pe, int step, bool add) {
  const HeapView& h = p.heap;
  const uint64_t e = EpochWith(p, pe);
  const uint4* cells = LlAt(h, e, kPhaseInterNode, pe);
#pragma unroll
  for (int c = 0; c < kCells; ++c) {
    const uint2 v = LoadLL(cells + l * kCells + c, static_cast<uint32_t>(e), p, pe, step);
    // fp32 addition commutes, so both partners of a step hold identical bits.
    acc[2 * c] = add ? acc[2 * c] + __uint_as_float(v.x) : __uint_as_float(v.x);
    acc[2 * c + 1] = add ? acc[2 * c + 1] + __uint_as_float(v.y) : __uint_as_float(v.y);
  }
}

// The hierarchical all-reduce with the LL8 protocol in every phase, each
// thread carrying one 8-byte line of its rank's shard through all of them in
// registers: the intra-node reduce-scatter sends every peer its shard's lines
// as LL8 cells (as TwoShotLLKernel), the thread sums its line in rank order in
// fp32, exchanges that partial with each recursive-doubling partner (MPICH
// fold for a node count that is not a power of two) as fp32 LL8 cells,
// direct stores or NVSHMEM puts, rounds the result to T once and sends it to
// every local peer's all-gather slot. Same sums in the same order as
// ReduceScatterAllGatherKernel<T, true>, so the same bits; without its fp32
// accumulator passes through memory, its barriers between phases (only the
// put path has one, for the bulk put) and its flag round trips within the
// node. A block holds at most kThreads lines of a shard (ChunkCapacity cuts
// larger messages into launches). Source: NVRAR (arXiv 2511.09557, sec. 4);
// docs/kernels.md, "hierarchical v4".
template <typename T>
__global__ void __launch_bounds__(kThreads) HierarchicalLLKernel(Params p) {
  constexpr size_t kLineElems = 8 / sizeof(T);
  constexpr int kCells = kLineElems / 2;  // inter-node LL8 cells a line (two fp32 each)
  const Topology& t = p.topo;
  const HeapView& h = p.heap;
  const T* in = static_cast<const T*>(p.in);
  T* out = static_cast<T*>(p.out);
  const int G = t.local_size;
  const size_t lines_per_block = p.per_block / kLineElems;  // <= kThreads
  auto line_end = [&](int q) {  // q's shard: this block's lines end here
    size_t lb, le;
    UnitRange(ShardLen(p, q), kLineElems, lines_per_block, blockIdx.x, &lb, &le);
    return le;
  };
  const size_t l = blockIdx.x * lines_per_block + threadIdx.x;  // this thread's line
  const bool in_block = threadIdx.x < lines_per_block;
  uint64_t epoch[kMaxGroupSize];
  LocalGroupEpochs(p, G, epoch);

  // Reduce-scatter within the node: line l of every peer's shard to that peer.
#pragma unroll
  for (int q = 0; q < kMaxGroupSize; ++q) {
    if (q >= G || q == t.local_rank || !in_block || l >= line_end(q)) continue;
    uint4* dst = PeerPtr(h, LlAt(h, epoch[q], kPhaseReduceScatter, p.my_pe), t.local_pes[q]);
    StoreLL(dst + l, LoadPadded<uint2>(in + static_cast<size_t>(q) * p.shard, l * kLineElems,
                                       ShardLen(p, q)),
            static_cast<uint32_t>(epoch[q]));
  }
  const size_t my_len = ShardLen(p, t.local_rank);
  const size_t my_off = static_cast<size_t>(t.local_rank) * p.shard;
  const size_t my_end = line_end(t.local_rank);
  const bool has = in_block && l < my_end;
  float acc[kLineElems];
#pragma unroll
  for (int i = 0; i < kLineElems; ++i) acc[i] = kSumIdentity;
  if (has) {
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r >= G) break;
      const uint2 v = r == t.local_rank
                          ? LoadPadded<uint2>(in + my_off, l * kLineElems, my_len)
                          : LoadLL(LlAt(h, epoch[r], kPhaseReduceScatter, t.local_pes[r]) + l,
                                   static_cast<uint32_t>(epoch[r]), p, t.local_pes[r],
                                   /*step=*/0);
      float f[kLineElems];
      Words<T>::ToFloat(v.x, f);
      Words<T>::ToFloat(v.y, f + Words<T>::kPerWord);
#pragma unroll
      for (int i = 0; i < kLineElems; ++i) acc[i] += f[i];
    }
  }

  // Recursive doubling among the nodes (same local rank), with the MPICH fold:
  // node pow2 + i hands its partial to node i before the doubling and gets
  // the result back after it. The block's cells for a bulk put:
  const size_t cb = min(my_end, blockIdx.x * lines_per_block) * kCells;
  const size_t ce = my_end * kCells;
  bool used_put = false;
  bool busy[2] = {false, false};  // staging buffers a put may still read (SendPartialLL)
  if (t.num_nodes > 1) {
    int pow2 = 1;
    while (pow2 * 2 <= t.num_nodes) pow2 *= 2;
    int step = 1;  // step numbers in timeout reports (0: reduce-scatter, 99: all-gather)
    int stage_index = 0;
    if (t.node >= pow2) {
      const int partner = t.node_pes[t.node - pow2];
      SendPartialLL<kCells>(p, acc, l, has, cb, ce, partner, stage_index, busy, &used_put);
      if (has) RecvPartialLL<kCells>(p, acc, l, partner, step, /*add=*/false);
    } else {
      const bool has_extra = t.node + pow2 < t.num_nodes;
      if (has_extra && has) {
        RecvPartialLL<kCells>(p, acc, l, t.node_pes[t.node + pow2], step, /*add=*/true);
      }
      if (has_extra) ++step;
      for (int mask = 1; mask < pow2; mask <<= 1) {
        const int partner = t.node_pes[t.node ^ mask];
        SendPartialLL<kCells>(p, acc, l, has, cb, ce, partner, stage_index, busy, &used_put);
        stage_index ^= 1;
        if (has) RecvPartialLL<kCells>(p, acc, l, partner, step, /*add=*/true);
        ++step;
      }
      if (has_extra) {
        SendPartialLL<kCells>(p, acc, l, has, cb, ce, t.node_pes[t.node + pow2], stage_index,
                              busy, &used_put);
      }
    }
  }

  // All-gather within the node: the line, rounded to T once, to my output and
  // to every peer; then the peers' lines from my slots.
  if (has) {
    const uint2 res =
        make_uint2(Words<T>::FromFloat(acc), Words<T>::FromFloat(acc + Words<T>::kPerWord));
#pragma unroll
    for (int r = 0; r < kMaxGroupSize; ++r) {
      if (r < G && r != t.local_rank) {
        StoreLL(PeerPtr(h, LlAt(h, epoch[r], kPhaseAllGather, p.my_pe), t.local_pes[r]) + l, res,
                static_cast<uint32_t>(epoch[r]));
      }
    }
    StorePadded(out + my_off, l * kLineElems, my_len, res);
  }
#pragma unroll
  for (int q = 0; q < kMaxGroupSize; ++q) {
    if (q >= G || q == t.local_rank || !in_block || l >= line_end(q)) continue;
    StorePadded(out + static_cast<size_t>(q) * p.shard, l * kLineElems, ShardLen(p, q),
                LoadLL(LlAt(h, epoch[q], kPhaseAllGather, t.local_pes[q]) + l,
                       static_cast<uint32_t>(epoch[q]), p, t.local_pes[q], /*step=*/99));
  }
  Finish(p, /*quiet=*/used_put);
}

// ---------------------------------------------------------------- host side

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

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }
size_t RoundUp(size_t a, size_t b) { return CeilDiv(a, b) * b; }

// Measurement knobs: environment variables, each read once per process, that
// switch a kernel variant or a grid shape for an A/B timing (docs/design.md
// lists them). Unset, they change nothing; set, the process says so on stderr.

// Whether the environment variable `name` is exactly `value`; if it is, says
// so on stderr with `what` (the variant it selects).
bool KnobIs(const char* name, const char* value, const char* what) {
  const char* v = std::getenv(name);
  const bool set = v != nullptr && std::strcmp(v, value) == 0;
  if (set) {
    std::fprintf(stderr, "jaxoverlap: measurement knob set: %s (%s=%s)\n", what, name, value);
  }
  return set;
}

// The non-negative integer in the environment variable `name`, or `fallback`
// where it is unset or empty; *set becomes true where it is set. A value that
// is not one is ignored, saying so on stderr (initialize() refuses it first:
// jaxoverlap/runtime.py, _INTEGER_KNOBS).
long long KnobInt(const char* name, long long fallback, bool* set) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || value < 0) {
    std::fprintf(stderr, "jaxoverlap: measurement knob %s=%s is not a non-negative integer; "
                 "ignored\n", name, v);
    return fallback;
  }
  *set = true;
  return value;
}

// The Lamport kernels' grid, for timing its variants side by side
// (scripts/gpu_check.sh lamportab): JAXOVERLAP_LAMPORT_BLOCKS_PER_SM (1, 2 or
// 4: the blocks an SM the kernels are compiled for, so their register cap;
// default kLamportBlocksPerSm), JAXOVERLAP_LAMPORT_BLOCK_BYTES (default
// kLamportBytesPerBlock), JAXOVERLAP_LAMPORT_MAX_BLOCKS (0: what the GPU holds
// at once) and JAXOVERLAP_LAMPORT_POLL_NS (a back-off after a poll that found
// the slot empty; 0: none).
struct LamportKnobConfig {
  int blocks_per_sm = kLamportBlocksPerSm;
  size_t block_bytes = kLamportBytesPerBlock;
  size_t max_blocks = 0;
  unsigned int poll_ns = 0;
};

const LamportKnobConfig& LamportKnobs() {
  static const LamportKnobConfig knobs = [] {
    LamportKnobConfig k;
    bool any = false;
    k.blocks_per_sm =
        static_cast<int>(KnobInt("JAXOVERLAP_LAMPORT_BLOCKS_PER_SM", k.blocks_per_sm, &any));
    k.block_bytes = std::max<size_t>(
        16, static_cast<size_t>(KnobInt("JAXOVERLAP_LAMPORT_BLOCK_BYTES", k.block_bytes, &any)));
    k.max_blocks = static_cast<size_t>(KnobInt("JAXOVERLAP_LAMPORT_MAX_BLOCKS", 0, &any));
    k.poll_ns = static_cast<unsigned int>(KnobInt("JAXOVERLAP_LAMPORT_POLL_NS", 0, &any));
    if (k.blocks_per_sm != 1 && k.blocks_per_sm != 2 && k.blocks_per_sm != 4) {
      std::fprintf(stderr, "jaxoverlap: JAXOVERLAP_LAMPORT_BLOCKS_PER_SM=%d is not 1, 2 or 4; "
                   "ignored\n", k.blocks_per_sm);
      k.blocks_per_sm = kLamportBlocksPerSm;
    }
    if (any) {
      std::fprintf(stderr, "jaxoverlap: Lamport measurement knobs set: %d blocks/SM, %zu B a "
                   "block, max %zu blocks (0: what fits), poll back-off %u ns\n",
                   k.blocks_per_sm, k.block_bytes, k.max_blocks, k.poll_ns);
    }
    return k;
  }();
  return knobs;
}

// JAXOVERLAP_EPOCH_AT_START=1: the one-shot LL kernels (all_reduce's and
// all_reduce_rms_norm's) advance the pair epochs at their start
// (AdvanceEpochsAtStart) instead of in Finish.
bool EpochKnob() {
  static const bool on = KnobIs("JAXOVERLAP_EPOCH_AT_START", "1",
                                "the one-shot LL kernels advance the epochs at their start");
  return on;
}

// JAXOVERLAP_HIERARCHICAL_LL=v3: hierarchical with the LL protocol runs
// ReduceScatterAllGatherKernel<T, true> (the v3 kernel: an fp32 accumulator in
// memory, flags within the node) instead of HierarchicalLLKernel, for an A/B of
// the two (scripts/gpu_check.sh hierab).
bool HierarchicalV3Knob() {
  static const bool on =
      KnobIs("JAXOVERLAP_HIERARCHICAL_LL", "v3", "hierarchical LL runs the v3 kernel");
  return on;
}

// The Lamport grid's cap: as many blocks as the GPU holds at once, so that it
// runs in one wave (RuntimeState::lamport_blocks_per_sm, from LamportBlocksPerSm).
int LamportMaxBlocks(const RuntimeState& s) {
  return std::max(1, s.lamport_blocks_per_sm) * s.num_sms;
}

// Launch configuration of one call (one chunk), from the problem size only,
// so that every rank of a group computes the same grid.
struct LaunchConfig {
  int blocks = 1;
  size_t per_block = 0;  // elements
  size_t shard = 0;      // elements (RS/AG)
};

LaunchConfig MakeLaunchConfig(Algorithm algorithm, Protocol protocol, size_t n, size_t elem,
                              int local_size, int lamport_max_blocks) {
  const size_t vec = 16 / elem;
  const LamportKnobConfig& knobs = LamportKnobs();
  const size_t per_block_bytes = protocol == Protocol::kLL        ? kLLBytesPerBlock
                                 : protocol == Protocol::kLamport ? knobs.block_bytes
                                                                  : kSimpleBytesPerBlock;
  const size_t max_blocks =
      protocol == Protocol::kLamport
          ? (knobs.max_blocks != 0 ? knobs.max_blocks : static_cast<size_t>(lamport_max_blocks))
          : kMaxBlocks;
  LaunchConfig c;
  if (algorithm == Algorithm::kOneShot) {
    c.blocks =
        static_cast<int>(std::clamp<size_t>(CeilDiv(n * elem, per_block_bytes), 1, max_blocks));
    c.per_block = RoundUp(CeilDiv(n, c.blocks), vec);
    return c;
  }
  c.shard = RoundUp(CeilDiv(n, local_size), vec);
  c.blocks = static_cast<int>(
      std::clamp<size_t>(CeilDiv(c.shard * elem, per_block_bytes), 1, max_blocks));
  c.per_block = RoundUp(CeilDiv(c.shard, c.blocks), vec);
  return c;
}

// Largest number of elements one launch can carry, a multiple of
// local_size * 16 bytes so that chunks keep shards vector-aligned.
size_t ChunkCapacity(Algorithm algorithm, Protocol protocol, size_t elem, int local_size,
                     const RuntimeState& s) {
  const size_t unit = static_cast<size_t>(local_size) * (16 / elem);
  size_t cap;
  if (algorithm == Algorithm::kOneShot) {
    cap = protocol == Protocol::kLL        ? (s.ll_slot_bytes / 16) * (8 / elem)
          : protocol == Protocol::kLamport ? s.lamport_slot_bytes / elem
                                           : s.slot_bytes / elem;
  } else if (protocol == Protocol::kLamport) {
    cap = s.lamport_slot_bytes / elem * local_size;  // a shard per slot
  } else {
    // Shard in T (RS/AG slots), in fp32 (acc, inter-node slots), in LL8 lines.
    size_t shard = std::min(s.slot_bytes / elem, s.acc_bytes / sizeof(float));
    if (protocol == Protocol::kLL) shard = std::min(shard, s.ll_slot_bytes / 8);
    if (protocol == Protocol::kLL && algorithm == Algorithm::kHierarchical &&
        !HierarchicalV3Knob()) {
      // HierarchicalLLKernel: at most one 8-byte line of the shard a thread.
      shard = std::min(shard, static_cast<size_t>(kMaxBlocks) * kThreads * (8 / elem));
    }
    cap = shard * local_size;
  }
  return cap / unit * unit;
}

// The names of the decoded enums (for messages), or null for a value that
// names no enumerator (the FFI decodes enum attributes without a range check).
const char* AlgorithmName(Algorithm a) {
  switch (a) {
    case Algorithm::kOneShot: return "one_shot";
    case Algorithm::kTwoShot: return "two_shot";
    case Algorithm::kHierarchical: return "hierarchical";
  }
  return nullptr;
}

const char* ProtocolName(Protocol p) {
  switch (p) {
    case Protocol::kLL: return "ll";
    case Protocol::kSimple: return "simple";
    case Protocol::kLamport: return "lamport";
  }
  return nullptr;
}

template <typename T>
cudaError_t Launch(Algorithm algorithm, Protocol protocol, const LaunchConfig& c,
                   const Params& p, cudaStream_t stream) {
  if (algorithm == Algorithm::kOneShot) {
    if (protocol == Protocol::kLL) {
      OneShotLLKernel<T><<<c.blocks, kThreads, 0, stream>>>(p);
    } else if (protocol == Protocol::kLamport) {
      switch (LamportKnobs().blocks_per_sm) {
        case 1: OneShotLamportKernel<T, 1><<<c.blocks, kThreads, 0, stream>>>(p); break;
        case 4: OneShotLamportKernel<T, 4><<<c.blocks, kThreads, 0, stream>>>(p); break;
        default: OneShotLamportKernel<T, kLamportBlocksPerSm><<<c.blocks, kThreads, 0, stream>>>(p);
      }
    } else {
      OneShotSimpleKernel<T><<<c.blocks, kThreads, 0, stream>>>(p);
    }
  } else if (algorithm == Algorithm::kTwoShot && protocol == Protocol::kLL) {
    TwoShotLLKernel<T><<<c.blocks, kThreads, 0, stream>>>(p);
  } else if (algorithm == Algorithm::kTwoShot && protocol == Protocol::kLamport) {
    switch (LamportKnobs().blocks_per_sm) {
      case 1: TwoShotLamportKernel<T, 1><<<c.blocks, kThreads, 0, stream>>>(p); break;
      case 4: TwoShotLamportKernel<T, 4><<<c.blocks, kThreads, 0, stream>>>(p); break;
      default: TwoShotLamportKernel<T, kLamportBlocksPerSm><<<c.blocks, kThreads, 0, stream>>>(p);
    }
  } else if (protocol == Protocol::kLL) {
    if (HierarchicalV3Knob()) {
      ReduceScatterAllGatherKernel<T, true><<<c.blocks, kThreads, 0, stream>>>(p);
    } else {
      HierarchicalLLKernel<T><<<c.blocks, kThreads, 0, stream>>>(p);
    }
  } else {
    ReduceScatterAllGatherKernel<T, false><<<c.blocks, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
ffi::Error PreloadKernelsOf() {
  cudaFuncAttributes a;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, OneShotLLKernel<T>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, OneShotSimpleKernel<T>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, OneShotLamportKernel<T, 1>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&a, OneShotLamportKernel<T, kLamportBlocksPerSm>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, OneShotLamportKernel<T, 4>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, TwoShotLLKernel<T>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, TwoShotLamportKernel<T, 1>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&a, TwoShotLamportKernel<T, kLamportBlocksPerSm>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, TwoShotLamportKernel<T, 4>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&a, ReduceScatterAllGatherKernel<T, true>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&a, ReduceScatterAllGatherKernel<T, false>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, HierarchicalLLKernel<T>));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&a, OneShotLLRmsNormKernel<T>));
  return ffi::Error::Success();
}

// The parameters every launch of one call shares: the heap, the epochs and
// the peers whose pair epoch the call advances.
Params MakeParams(const RuntimeState& s, const Topology& topo) {
  Params p{};
  p.stage = Stage::kAll;
  p.topo = topo;
  p.my_pe = s.my_pe;
  p.heap.peers = s.peers;
  p.heap.flags = s.flags;
  p.heap.ll = s.ll;
  p.heap.lamport = s.lamport;
  p.heap.lamport_slot_bytes = s.lamport_slot_bytes;
  p.heap.ranks_per_node = s.ranks_per_node;
  p.heap.data = s.data;
  p.heap.acc[0] = reinterpret_cast<float*>(s.acc[0]);
  p.heap.acc[1] = reinterpret_cast<float*>(s.acc[1]);
  p.heap.stage[0] = reinterpret_cast<uint4*>(s.stage[0]);
  p.heap.stage[1] = reinterpret_cast<uint4*>(s.stage[1]);
  p.heap.slot_bytes = s.slot_bytes;
  p.heap.ll_slot_bytes = s.ll_slot_bytes;
  p.heap.num_pes = s.num_pes;
  p.pair_epochs = s.pair_epochs;
  p.done_counter = s.done_counter;
  p.error = s.error_device;
  p.op = OpId::kAllReduce;
  p.timeout_ns = s.timeout_ns;
  p.force_put = s.force_put;
  // Peers whose pair epoch this call advances: local peers, inter-node partners.
  for (int r = 0; r < topo.local_size; ++r) {
    if (r != topo.local_rank) p.bump[p.num_bump++] = topo.local_pes[r];
  }
  if (topo.num_nodes > 1) {
    int pow2 = 1;
    while (pow2 * 2 <= topo.num_nodes) pow2 *= 2;
    if (topo.node >= pow2) {
      p.bump[p.num_bump++] = topo.node_pes[topo.node - pow2];
    } else {
      if (topo.node + pow2 < topo.num_nodes) p.bump[p.num_bump++] = topo.node_pes[topo.node + pow2];
      for (int mask = 1; mask < pow2; mask <<= 1) p.bump[p.num_bump++] = topo.node_pes[topo.node ^ mask];
    }
  }

  return p;
}

}  // namespace

namespace {

template <int kMinBlocks>
ffi::Error LamportOccupancy(int* blocks) {
  int fewest = kMinBlocks;
  const void* kernels[] = {
      reinterpret_cast<const void*>(OneShotLamportKernel<float, kMinBlocks>),
      reinterpret_cast<const void*>(OneShotLamportKernel<__nv_bfloat16, kMinBlocks>),
      reinterpret_cast<const void*>(OneShotLamportKernel<__half, kMinBlocks>),
      reinterpret_cast<const void*>(TwoShotLamportKernel<float, kMinBlocks>),
      reinterpret_cast<const void*>(TwoShotLamportKernel<__nv_bfloat16, kMinBlocks>),
      reinterpret_cast<const void*>(TwoShotLamportKernel<__half, kMinBlocks>)};
  for (const void* kernel : kernels) {
    int n = 0;
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
    fewest = std::min(fewest, n);
  }
  *blocks = fewest;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error LamportBlocksPerSm(int* blocks) {
  switch (LamportKnobs().blocks_per_sm) {
    case 1: return LamportOccupancy<1>(blocks);
    case 4: return LamportOccupancy<4>(blocks);
    default: return LamportOccupancy<kLamportBlocksPerSm>(blocks);
  }
}

namespace {

// all_reduce_rms_norm's blocks per row, the measurement knob
// JAXOVERLAP_NORM_CLUSTER (1 .. kMaxNormCluster); 0 (unset or 0): from the
// row's size (kNormLinesPerBlock).
int NormKnob() {
  static const int knob = [] {
    bool set = false;
    const long long v = KnobInt("JAXOVERLAP_NORM_CLUSTER", 0, &set);
    if (v <= 0) return 0;
    const int k = static_cast<int>(std::min<long long>(v, kMaxNormCluster));
    std::fprintf(stderr, "jaxoverlap: measurement knob set: all_reduce_rms_norm with %d "
                 "blocks a row (JAXOVERLAP_NORM_CLUSTER)\n", k);
    return k;
  }();
  return knob;
}

// The launch attribute of clusters of `blocks` blocks.
cudaLaunchAttribute ClusterOf(int blocks) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = static_cast<unsigned int>(blocks);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

// The launch of `blocks` blocks of `threads` in clusters (`cluster_dim`).
cudaLaunchConfig_t NormLaunchConfig(unsigned int blocks, int threads, cudaStream_t stream,
                                    cudaLaunchAttribute* cluster_dim) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(static_cast<unsigned int>(threads));
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = cluster_dim;
  config.numAttrs = 1;
  return config;
}

template <typename T>
ffi::Error NormClustersOf(int c, int* clusters) {
  cudaLaunchAttribute cluster_dim = ClusterOf(c);
  const cudaLaunchConfig_t config =
      NormLaunchConfig(static_cast<unsigned int>(c), kThreads, nullptr, &cluster_dim);
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveClusters(clusters, OneShotLLRmsNormKernel<T>, &config));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error PreloadKernels() {
  JAXOVERLAP_RETURN_IF_ERROR(PreloadKernelsOf<float>());
  JAXOVERLAP_RETURN_IF_ERROR(PreloadKernelsOf<__nv_bfloat16>());
  return PreloadKernelsOf<__half>();
}

const char* HierarchicalLLKernelName() { return HierarchicalV3Knob() ? "v3" : "v4"; }

bool EpochsAtStart() { return EpochKnob(); }

int NormBlocksPerRowKnob() { return NormKnob(); }

ffi::Error NormClustersAtOnce(int* clusters) {
  int device = 0, cluster_launch = 0, sms = 0;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  clusters[0] = 0;
  // One block: the plain occupancy (the launch then has no cluster attribute).
  int f32 = 0, bf16 = 0, f16 = 0;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &f32, OneShotLLRmsNormKernel<float>, kThreads, 0));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &bf16, OneShotLLRmsNormKernel<__nv_bfloat16>, kThreads, 0));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &f16, OneShotLLRmsNormKernel<__half>, kThreads, 0));
  clusters[1] = std::min({f32, bf16, f16}) * sms;
  for (int c = 2; c <= kMaxNormCluster; ++c) {
    clusters[c] = 0;
    if (!cluster_launch) continue;  // before Hopper: rows on one block each
    JAXOVERLAP_RETURN_IF_ERROR(NormClustersOf<float>(c, &f32));
    JAXOVERLAP_RETURN_IF_ERROR(NormClustersOf<__nv_bfloat16>(c, &bf16));
    JAXOVERLAP_RETURN_IF_ERROR(NormClustersOf<__half>(c, &f16));
    clusters[c] = std::min({f32, bf16, f16});
  }
  return ffi::Error::Success();
}

ffi::Error CheckLocalPeers(const RuntimeState& s, const Topology& t, const char* op) {
  for (int r = 0; r < t.local_size; ++r) {
    const int pe = t.local_pes[r];
    if (pe == s.my_pe || PeerAddress(s.peers, s.heap, pe) != nullptr) continue;
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": PE " + std::to_string(s.my_pe) + " cannot load/store "
                      "PE " + std::to_string(pe) + "'s memory (no NVLink or PCIe peer access "
                      "between their GPUs), and the intra-node steps need it; with "
                      "ranks_per_node=" + std::to_string(s.ranks_per_node) + " both count as "
                      "one node. Set JAXOVERLAP_RANKS_PER_NODE to the GPUs that reach each "
                      "other, or use backend 'xla'");
  }
  return ffi::Error::Success();
}

std::vector<int> UnreachableLocalPes(const RuntimeState& s) {
  std::vector<int> out;
  if (!s.initialized || s.ranks_per_node < 1) return out;
  const int first = (s.my_pe / s.ranks_per_node) * s.ranks_per_node;
  for (int pe = first; pe < std::min(first + s.ranks_per_node, s.num_pes); ++pe) {
    if (pe != s.my_pe && PeerAddress(s.peers, s.heap, pe) == nullptr) out.push_back(pe);
  }
  return out;
}

ffi::Error MakeTopology(const char* op, const int64_t* groups, size_t num_entries,
                        int64_t group_size, int my_pe, int num_pes, int ranks_per_node,
                        Topology* topo) {
  const std::string who = std::string(op) + ": ";
  if (group_size < 1 || num_entries % group_size != 0) {
    return ffi::Error::InvalidArgument(who + "groups attribute has " +
                                       std::to_string(num_entries) +
                                       " entries, not a multiple of group size " +
                                       std::to_string(group_size));
  }
  const int64_t* g = nullptr;
  for (size_t start = 0; start < num_entries && g == nullptr; start += group_size) {
    for (int64_t r = 0; r < group_size; ++r) {
      if (groups[start + r] == my_pe) g = groups + start;
    }
  }
  if (g == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      who + "PE " + std::to_string(my_pe) +
                          " is in none of the groups of this call; the mesh's devices and the "
                          "runtime's PEs disagree (jaxoverlap.runtime.pe_of_device)");
  }
  Topology t;
  t.num_ranks = static_cast<int>(group_size);
  int nodes[kMaxNodes];
  int num_nodes = 0;
  for (int64_t r = 0; r < group_size; ++r) {
    if (g[r] < 0 || g[r] >= num_pes) {
      return ffi::Error::InvalidArgument(who + "group names PE " + std::to_string(g[r]) +
                                         " but the runtime has " + std::to_string(num_pes) + " PEs");
    }
    if (std::find(g, g + r, g[r]) != g + r) {
      return ffi::Error::InvalidArgument(who + "the group names PE " + std::to_string(g[r]) +
                                         " twice");
    }
    if (g[r] == my_pe) t.rank = static_cast<int>(r);
    const int node = static_cast<int>(g[r] / ranks_per_node);
    if (std::find(nodes, nodes + num_nodes, node) == nodes + num_nodes) {
      if (num_nodes == kMaxNodes) {
        return ffi::Error::InvalidArgument(who + "the group spans more than " +
                                           std::to_string(kMaxNodes) + " nodes");
      }
      nodes[num_nodes++] = node;
    }
  }
  std::sort(nodes, nodes + num_nodes);
  const int my_node = my_pe / ranks_per_node;
  // Members per node, in rank order.
  int per_node[kMaxNodes] = {};
  for (int k = 0; k < num_nodes; ++k) {
    for (int64_t r = 0; r < group_size; ++r) {
      if (g[r] / ranks_per_node == nodes[k]) ++per_node[k];
    }
    if (per_node[k] != per_node[0]) {
      return ffi::Error::InvalidArgument(
          who + "the group has " + std::to_string(per_node[0]) + " ranks on one node and " +
          std::to_string(per_node[k]) + " on another; the hierarchical algorithms need the same "
          "number on every node");
    }
  }
  if (per_node[0] > kMaxGroupSize) {
    return ffi::Error::InvalidArgument(who + std::to_string(per_node[0]) +
                                       " ranks of one group on one node; at most " +
                                       std::to_string(kMaxGroupSize) + " are supported");
  }
  t.local_size = per_node[0];
  t.num_nodes = num_nodes;
  for (int k = 0; k < num_nodes; ++k) {
    if (nodes[k] == my_node) t.node = k;
  }
  int l = 0;
  for (int64_t r = 0; r < group_size; ++r) {
    if (g[r] / ranks_per_node == my_node) {
      if (g[r] == my_pe) t.local_rank = l;
      t.local_pes[l++] = static_cast<int>(g[r]);
    }
  }
  for (int k = 0; k < num_nodes; ++k) {
    int seen = 0;
    for (int64_t r = 0; r < group_size; ++r) {
      if (g[r] / ranks_per_node != nodes[k]) continue;
      if (seen++ == t.local_rank) t.node_pes[k] = static_cast<int>(g[r]);
    }
  }
  *topo = t;
  return ffi::Error::Success();
}

ffi::Error AllReduce(const RuntimeState& s, cudaStream_t stream, Algorithm algorithm,
                     Protocol protocol, ffi::DataType dtype, const void* in, void* out,
                     size_t num_elements, const Topology& topo) {
  if (!s.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "all_reduce: jaxoverlap.initialize() has not been called in this process");
  }
  const size_t elem = ElementBytes(dtype);
  if (elem == 0) {
    return ffi::Error::InvalidArgument("all_reduce: dtype must be float32, bfloat16 or float16");
  }
  if (AlgorithmName(algorithm) == nullptr || ProtocolName(protocol) == nullptr) {
    return ffi::Error::InvalidArgument(
        "all_reduce: algorithm " + std::to_string(static_cast<int>(algorithm)) + " or protocol " +
        std::to_string(static_cast<int>(protocol)) +
        " is not an enumerator of all_reduce.h (the extension and the Python package disagree)");
  }
  if (protocol == Protocol::kLamport && algorithm == Algorithm::kHierarchical) {
    return ffi::Error::InvalidArgument(
        "all_reduce: protocol lamport runs within one node (one_shot, two_shot); hierarchical "
        "takes ll or simple");
  }
  if (algorithm == Algorithm::kHierarchical && topo.num_nodes > 1 && s.mode != Mode::kNvshmem) {
    // The kernels' inter-node step is NVSHMEM's puts; across processes the
    // in-process runtime runs it as XLA's collective (the stage handlers).
    return ffi::Error::InvalidArgument(
        "all_reduce: hierarchical across " + std::to_string(topo.num_nodes) +
        " nodes needs the NVSHMEM runtime (one GPU per process); this process drives its GPUs "
        "in-process, where the dispatcher runs the inter-node step as XLA's all-reduce");
  }
  if ((algorithm == Algorithm::kOneShot || algorithm == Algorithm::kTwoShot) && topo.num_nodes > 1) {
    return ffi::Error::InvalidArgument(
        std::string("all_reduce: ") + AlgorithmName(algorithm) +
        " needs the whole group on one node, but it spans " + std::to_string(topo.num_nodes) +
        " nodes (ranks_per_node " + std::to_string(s.ranks_per_node) + "); use hierarchical");
  }
  if (num_elements == 0) return ffi::Error::Success();

  if (protocol == Protocol::kLamport && s.lamport_slot_bytes == 0) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "all_reduce: protocol lamport has no slots: the symmetric heap of " +
                          std::to_string(s.heap_bytes) + " bytes leaves none beside the other "
                          "slots of " + std::to_string(s.num_pes) + " PEs; raise "
                          "JAXOVERLAP_HEAP_BYTES, or use protocol ll or simple");
  }
  const size_t capacity = ChunkCapacity(algorithm, protocol, elem, topo.local_size, s);
  if (capacity == 0) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "all_reduce: the symmetric heap's slots are too small for one vector per "
                      "rank; raise JAXOVERLAP_HEAP_BYTES");
  }

  Params p = MakeParams(s, topo);

  for (size_t offset = 0; offset < num_elements; offset += capacity) {
    const size_t n = std::min(capacity, num_elements - offset);
    const LaunchConfig c =
        MakeLaunchConfig(algorithm, protocol, n, elem, topo.local_size, LamportMaxBlocks(s));
    if (algorithm == Algorithm::kHierarchical && protocol == Protocol::kLL &&
        !HierarchicalV3Knob() && c.per_block / (8 / elem) > static_cast<size_t>(kThreads)) {
      return ffi::Error(ffi::ErrorCode::kInternal,
                        "all_reduce (hierarchical, ll): " + std::to_string(c.per_block) +
                            " elements a block exceed one line a thread (ChunkCapacity and "
                            "MakeLaunchConfig disagree)");
    }
    p.in = static_cast<const char*>(in) + offset * elem;
    p.out = static_cast<char*>(out) + offset * elem;
    p.n = n;
    p.per_block = c.per_block;
    p.shard = c.shard;
    p.poll_ns = LamportKnobs().poll_ns;
    p.epochs_at_start = EpochKnob();
    cudaError_t err;
    switch (dtype) {
      case ffi::DataType::F32:
        err = Launch<float>(algorithm, protocol, c, p, stream);
        break;
      case ffi::DataType::BF16:
        err = Launch<__nv_bfloat16>(algorithm, protocol, c, p, stream);
        break;
      default:
        err = Launch<__half>(algorithm, protocol, c, p, stream);
        break;
    }
    if (err != cudaSuccess) {
      const std::string what = std::string("all_reduce kernel launch (") +
                               AlgorithmName(algorithm) + ", " + ProtocolName(protocol) + ", " +
                               std::to_string(n) + " elements of " + std::to_string(elem) +
                               " bytes from element " + std::to_string(offset) + ", " +
                               std::to_string(c.blocks) + " blocks)";
      ffi::Error e = CudaError(err, what.c_str(), __FILE__, __LINE__);
      if (offset > 0) {  // earlier chunks ran: their epochs moved on, this chunk's did not
        RecordBrokenCall("all_reduce failed on PE " + std::to_string(s.my_pe) +
                         " after its first chunks had run (" + e.message() +
                         "); its epochs are out of step with its peers': restart the processes");
      }
      return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error AllReduceStage(const RuntimeState& s, cudaStream_t stream, Stage stage,
                          ffi::DataType dtype, const void* in, void* out, size_t num_elements,
                          size_t shard_elements, const Topology& topo) {
  const char* what = stage == Stage::kReduceScatter ? "all_reduce (intra-node reduce-scatter)"
                                                    : "all_reduce (intra-node all-gather)";
  if (!s.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(what) + ": jaxoverlap.initialize() has not been called in "
                                          "this process");
  }
  if (stage != Stage::kReduceScatter && stage != Stage::kAllGather) {
    return ffi::Error::InvalidArgument(std::string(what) + ": not a stage of its own");
  }
  const size_t elem = ElementBytes(dtype);
  if (elem == 0) {
    return ffi::Error::InvalidArgument(std::string(what) +
                                       ": dtype must be float32, bfloat16 or float16");
  }
  if (num_elements == 0) return ffi::Error::Success();
  // One launch carries the whole message: the caller (jaxoverlap/_cuda.py)
  // cuts larger ones into pieces, so that the shard layout is its own.
  const LaunchConfig c =
      MakeLaunchConfig(Algorithm::kTwoShot, Protocol::kSimple, num_elements, elem, topo.local_size,
                       LamportMaxBlocks(s));
  if (c.shard != shard_elements) {
    return ffi::Error::InvalidArgument(
        std::string(what) + ": the shard buffer has " + std::to_string(shard_elements) +
        " elements, but " + std::to_string(num_elements) + " elements over " +
        std::to_string(topo.local_size) + " local ranks make shards of " +
        std::to_string(c.shard) + " (the extension and the Python package disagree)");
  }
  if (c.shard * elem > s.slot_bytes) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(what) + ": a shard of " + std::to_string(c.shard * elem) +
                          " bytes exceeds the slot of " + std::to_string(s.slot_bytes) +
                          " bytes (the caller cuts messages into pieces that fit)");
  }
  Topology local = topo;  // only the node's peers take part; the nodes meet elsewhere
  local.num_nodes = 1;
  Params p = MakeParams(s, local);
  p.stage = stage;
  p.op = stage == Stage::kReduceScatter ? OpId::kAllReduceReduceScatterStage
                                        : OpId::kAllReduceAllGatherStage;
  p.in = in;
  p.out = out;
  p.shard_out = stage == Stage::kReduceScatter ? static_cast<float*>(out) : nullptr;
  p.shard_in = stage == Stage::kAllGather ? static_cast<const float*>(in) : nullptr;
  p.n = num_elements;
  p.per_block = c.per_block;
  p.shard = c.shard;
  cudaError_t err;
  switch (dtype) {
    case ffi::DataType::F32:
      err = Launch<float>(Algorithm::kTwoShot, Protocol::kSimple, c, p, stream);
      break;
    case ffi::DataType::BF16:
      err = Launch<__nv_bfloat16>(Algorithm::kTwoShot, Protocol::kSimple, c, p, stream);
      break;
    default:
      err = Launch<__half>(Algorithm::kTwoShot, Protocol::kSimple, c, p, stream);
      break;
  }
  if (err != cudaSuccess) {
    return CudaError(err, (std::string(what) + " kernel launch").c_str(), __FILE__, __LINE__);
  }
  return ffi::Error::Success();
}


ffi::Error AllReduceRmsNorm(const RuntimeState& s, cudaStream_t stream, ffi::DataType dtype,
                            const void* p, const void* residual, const void* weight, void* h,
                            void* y, size_t rows, size_t hidden, float eps,
                            const Topology& topo) {
  constexpr const char* kWhat = "all_reduce_rms_norm";
  if (!s.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(kWhat) + ": jaxoverlap.initialize() has not been called in "
                                           "this process");
  }
  const size_t elem = ElementBytes(dtype);
  if (elem == 0) {
    return ffi::Error::InvalidArgument(std::string(kWhat) +
                                       ": dtype must be float32, bfloat16 or float16");
  }
  if (topo.num_nodes > 1) {
    return ffi::Error::InvalidArgument(
        std::string(kWhat) + ": the fused kernel is a one-shot all-reduce within one node, but "
        "the group spans " + std::to_string(topo.num_nodes) + " nodes (ranks_per_node " +
        std::to_string(s.ranks_per_node) + ")");
  }
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    return ffi::Error::InvalidArgument(std::string(kWhat) + ": eps must be positive and finite");
  }
  if (hidden == 0 || (hidden * elem) % 8 != 0) {
    return ffi::Error::InvalidArgument(
        std::string(kWhat) + ": a row of " + std::to_string(hidden) + " elements of " +
        std::to_string(elem) + " bytes is not a whole number of 8-byte LL lines");
  }
  if (rows == 0) return ffi::Error::Success();
  const size_t row_lines = hidden * elem / 8;
  const size_t lines = rows * row_lines;
  if (lines * sizeof(uint4) > s.ll_slot_bytes) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kWhat) + ": the message (" +
                          std::to_string(rows * hidden * elem) + " bytes per rank) needs " + std::to_string(lines * sizeof(uint4)) +
                          " bytes of LL slot per sender, but the slot has " +
                          std::to_string(s.ll_slot_bytes) +
                          " (jaxoverlap.dispatch plans such calls on xla)");
  }
  NormParams np{};
  np.base = MakeParams(s, topo);
  np.base.op = OpId::kAllReduceRmsNorm;
  np.base.epochs_at_start = EpochKnob();
  np.base.in = p;
  np.base.out = h;
  np.base.n = rows * hidden;
  np.residual = residual;
  np.weight = weight;
  np.y = y;
  np.rows = rows;
  np.hidden = hidden;
  np.row_lines = row_lines;
  np.eps = eps;
  // A row's blocks: a cluster of `parts`, each with its 1/parts of the row's
  // lines, one thread per line in whole warps (at most kThreads); as many
  // clusters as rows, within kMaxBlocks blocks and what the GPU holds at once.
  // Fewer where the GPU holds no cluster of that many (before Hopper: one).
  int parts = NormKnob() != 0 ? NormKnob()
                              : static_cast<int>(std::clamp<size_t>(
                                    CeilDiv(row_lines, kNormLinesPerBlock), 1, kMaxNormCluster));
  while (parts > 1 && s.norm_clusters_at_once[parts] == 0) --parts;
  if (NormKnob() != 0 && parts != NormKnob()) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr, "jaxoverlap: JAXOVERLAP_NORM_CLUSTER=%d: GPU %d holds no cluster of "
                   "%d blocks; all_reduce_rms_norm runs with %d blocks a row\n", NormKnob(),
                   s.device, NormKnob(), parts);
    }
  }
  const size_t at_once = static_cast<size_t>(s.norm_clusters_at_once[parts]);
  if (at_once == 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(kWhat) + ": the occupancy calculator found no room for one "
                                           "block of the fused kernel on this GPU");
  }
  const size_t clusters = std::min({rows, at_once, static_cast<size_t>(kMaxBlocks / parts)});
  const int threads = static_cast<int>(
      std::clamp<size_t>(RoundUp(CeilDiv(row_lines, parts), 32), 32, kThreads));
  cudaLaunchAttribute cluster_dim = ClusterOf(parts);
  cudaLaunchConfig_t config =
      NormLaunchConfig(static_cast<unsigned int>(clusters * parts), threads, stream, &cluster_dim);
  if (parts == 1) config.numAttrs = 0;  // no cluster: also where the GPU has none
  cudaError_t err;
  switch (dtype) {
    case ffi::DataType::F32:
      err = cudaLaunchKernelEx(&config, OneShotLLRmsNormKernel<float>, np);
      break;
    case ffi::DataType::BF16:
      err = cudaLaunchKernelEx(&config, OneShotLLRmsNormKernel<__nv_bfloat16>, np);
      break;
    default:
      err = cudaLaunchKernelEx(&config, OneShotLLRmsNormKernel<__half>, np);
      break;
  }
  const cudaError_t last = cudaGetLastError();  // also clears an error the launch left
  if (err == cudaSuccess) err = last;
  if (err != cudaSuccess) {
    const std::string what = "all_reduce_rms_norm kernel launch (" + std::to_string(rows) +
                             " rows of " + std::to_string(hidden) + ", " +
                             std::to_string(clusters) + " clusters of " + std::to_string(parts) +
                             " blocks of " + std::to_string(threads) + " threads)";
    return CudaError(err, what.c_str(), __FILE__, __LINE__);
  }
  return ffi::Error::Success();
}

}  // namespace jaxoverlap::all_reduce
