// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The runtime of one process: its GPUs, each a PE with one symmetric heap
// allocated once at start-up and sub-allocated deterministically (every PE
// computes the same layout, so offsets agree without communication). Two
// runtimes provide the heaps (transport.cuh says how kernels reach peers):
//  * NVSHMEM (Mode::kNvshmem): one PE per process, one GPU per PE.
//  * In-process (Mode::kPeer): one process drives several GPUs of a node; each
//    GPU is a PE with a cudaMalloc'ed heap, peer access enabled between them.
// State is kept per GPU (by CUDA ordinal), because XLA runs the handlers of a
// process's GPUs concurrently, each on its own stream.
//
// Heap layout (all symmetric; every PE computes the same offsets):
//   flags    [kNumParities][kNumPhases][num_pes][kMaxBlocks] uint64  "simple" completion flags
//   ll       [kNumParities][kNumPhases][num_pes][ll_slot_bytes]     LL8 cells (4 B data + 4 B flag)
//   lamport  [kNumParities][kNumLamportPhases][ranks_per_node][lamport_slot_bytes]
//            Lamport payloads, by the sender's index on its node; every byte
//            reads kLamportEmpty (0xff) between calls (all_reduce.cu)
//   scratch  stage[2][ll_slot_bytes] (LL8 packing), acc[2][slot_bytes] (fp32 partial sums)
//   data     [kNumParities][kNumPhases][num_pes][slot_bytes]        "simple" payloads
// and, after those `heap_bytes`, the fused ops' region of `overlap_bytes`:
//   oflags   [kMaxGroupSize][kNumOverlapPhases][kMaxChunks] uint64  "chunk arrived" flags
//   oacks    [kMaxGroupSize] uint64                                  "slot consumed" flags
//   oslots   [ranks_per_node + 1][overlap_slot_bytes]               payloads, by sender
// (overlap.cu explains the fused ops' completion protocol).
// Receive slots are indexed by the *sender's* PE, the algorithm phase and the
// parity of the per-pair epoch, so a sender can be one call ahead of a
// receiver without overwriting data the receiver still reads (all_reduce.cu
// gives the argument). LL8 and simple payloads never share memory, so a stale
// payload can never be mistaken for a flag.
#ifndef JAXOVERLAP_RUNTIME_H_
#define JAXOVERLAP_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace ffi = xla::ffi;

inline constexpr int kMaxDevices = 16;      // CUDA ordinals a process may drive
inline constexpr int kMaxBlocks = 128;      // blocks of one collective kernel
inline constexpr int kMaxNormCluster = 8;   // blocks of one row of all_reduce_rms_norm (portable)
inline constexpr int kNumParities = 2;      // double buffering by epoch parity
inline constexpr int kNumPhases = 3;        // reduce-scatter, inter-node, all-gather
inline constexpr int kMaxGroupSize = 8;     // ranks of one node in one group
inline constexpr int kMaxNodes = 64;        // nodes of one group
inline constexpr int kMaxPes = 512;         // PEs of the job (heap layout is per PE)
inline constexpr int kMaxChunks = 32;       // chunks of one shard transfer (fused ops)
inline constexpr int kNumOverlapPhases = 2; // reduce-scatter, all-gather (fused ops)
// LL8 cells per (parity, phase, sender): heap / (4 * slots), within these bounds.
inline constexpr size_t kMinLlSlotBytes = 256 * 1024;
inline constexpr size_t kMaxLlSlotBytes = 2 * 1024 * 1024;
// Lamport payloads per (parity, phase, sender on the node): heap / (8 * slots),
// within these bounds. Phases: one-shot and reduce-scatter, all-gather.
inline constexpr int kNumLamportPhases = 2;
inline constexpr size_t kMinLamportSlotBytes = 64 * 1024;
inline constexpr size_t kMaxLamportSlotBytes = 16 * 1024 * 1024;

// The op a kernel belongs to, for device error reports.
enum class OpId : int32_t {
  kUnknown = 0,
  kAllReduce = 1,
  kAllGatherMatmul = 2,
  kMatmulReduceScatter = 3,
  kMatmulAllReduce = 4,
  kAllReduceRmsNorm = 5,
  kAllReduceReduceScatterStage = 6,  // the intra-node stages around XLA's inter-node psum
  kAllReduceAllGatherStage = 7,
};
const char* OpName(int32_t op);

// What a timed-out device wait leaves behind, in mapped pinned host memory so
// that the host can read it even after the kernel trapped (the runtime's
// watchdog thread prints it to stderr at once; DeviceErrorToFfi words it).
// What a timed-out wait polled, which says how to read DeviceError's epoch and seen.
enum class WaitKind : int32_t {
  kSignal = 0,       // a 64-bit flag (simple protocol, fused ops): epoch and seen are call counts
  kLLFlag = 1,       // an LL line: epoch and seen are 32-bit flags, the call count's low bits
  kLamportData = 2,  // a Lamport slot: no signal; the data of call `epoch` did not arrive
};

// The first report claims the record (`claim`), writes its fields, then publishes `code`
// behind a fence; the other waiting threads wait for `code` before they trap, so a reader
// that sees a code sees every field of that report.
struct DeviceError {
  int32_t code;      // 0: none; 1: wait timed out; 2: an LL flag period end under the epoch knob
  int32_t rank;      // rank (in its group) of the PE that waited
  int32_t peer_pe;   // PE whose signal did not arrive
  int32_t step;      // algorithm step (0: one-shot receive)
  int32_t block;     // block (all-reduce; Lamport: the range's start ticket) or chunk (fused)
  int32_t op;        // OpId of the kernel that waited
  uint64_t epoch;    // epoch waited for (WaitKind says in what form)
  uint64_t seen;     // signal value seen at the timeout (none for kLamportData)
  int32_t claim;     // 0 until a report takes the record
  int32_t wait;      // WaitKind
};

enum class Mode : int32_t {
  kNone = 0,
  kNvshmem = 1,  // one PE per process (NVSHMEM)
  kPeer = 2,     // one process, several GPUs of one node (in-process peer access)
};

// Where this node's PEs keep their heaps (Mode::kPeer), or "ask NVSHMEM"
// (in_process false). Trivially copyable: passed by value to kernels.
struct PeerMap {
  bool in_process = false;
  int first_pe = 0;                 // PE of local index 0 (in_process)
  int num_local = 0;                // PEs of this node (in_process)
  const char* self = nullptr;       // this PE's heap (in_process)
  char* heaps[kMaxGroupSize] = {};  // each local PE's heap, by local index (in_process)
};

// The runtime of one GPU (PE).
struct RuntimeState {
  bool initialized = false;
  Mode mode = Mode::kNone;
  PeerMap peers;
  int my_pe = -1;
  int num_pes = 0;
  int device = -1;
  int num_sms = 0;  // streaming multiprocessors of this GPU (the Lamport grid)
  int lamport_blocks_per_sm = 0;  // Lamport blocks an SM holds at once (the Lamport grid)
  // Clusters of c blocks of all_reduce_rms_norm's kernel (512 threads) the GPU
  // holds at once, [c] for c = 1 .. kMaxNormCluster (its grid's cap; 0 where
  // the GPU has no clusters of c, as before Hopper for c > 1).
  int norm_clusters_at_once[kMaxNormCluster + 1] = {};
  size_t heap_bytes = 0;
  size_t slot_bytes = 0;
  size_t ll_slot_bytes = 0;
  uint64_t timeout_ns = 0;
  int ranks_per_node = 0;
  bool force_put = false;  // JAXOVERLAP_FORCE_NVSHMEM_PUT=1: no direct stores across nodes
  size_t acc_bytes = 0;
  char* heap = nullptr;              // symmetric, nvshmem_malloc'ed once
  uint64_t* flags = nullptr;         // symmetric, inside heap
  char* ll = nullptr;                // symmetric, inside heap
  char* lamport = nullptr;           // symmetric, inside heap
  size_t lamport_slot_bytes = 0;
  char* data = nullptr;              // symmetric, inside heap
  char* acc[2] = {nullptr, nullptr};    // this PE's fp32 accumulators (inside heap)
  char* stage[2] = {nullptr, nullptr};  // this PE's LL8 packing buffers (inside heap)
  uint64_t* pair_epochs = nullptr;   // device memory [num_pes]: calls made with each peer
  // Device memory, two counters of the current all-reduce call: [0] blocks
  // finished, [1] blocks started (the Lamport kernels' work tickets).
  unsigned int* done_counter = nullptr;
  DeviceError* error_host = nullptr;     // mapped pinned memory
  DeviceError* error_device = nullptr;   // its device alias
  // The fused ops (overlap.cu).
  size_t overlap_bytes = 0;
  size_t overlap_slot_bytes = 0;
  uint64_t* oflags = nullptr;        // symmetric, inside heap
  uint64_t* oacks = nullptr;         // symmetric, inside heap
  char* oslots = nullptr;            // symmetric, inside heap
  uint64_t* overlap_epochs = nullptr;  // device memory [num_pes]: fused calls made with each peer
  uint64_t* call_epochs = nullptr;     // device memory [kMaxGroupSize]: this call's epochs
  unsigned int* put_counter = nullptr;  // device memory: blocks of the running put kernel
  cudaStream_t comm_stream = nullptr;   // high-priority stream for the fused ops' transfers
  cudaEvent_t events[4] = {};           // fork/join and per-chunk hand-offs
};

// Brings NVSHMEM up with a unique id made by PE 0 and exchanged by the caller.
// `overlap_bytes` more of symmetric heap go to the fused ops.
ffi::Error Initialize(const std::string& unique_id, int rank, int num_ranks, int device,
                      size_t heap_bytes, size_t overlap_bytes, uint64_t timeout_ns,
                      int ranks_per_node);
// Brings the in-process runtime up on `devices` (CUDA ordinals, in local-rank
// order): PE first_pe + i on devices[i], of num_pes in the job; each process
// is one node of devices.size() PEs. Enables peer access between all pairs.
// Errors: a pair without peer access (named), allocation failures.
ffi::Error InitializePeer(const int* devices, int num_devices, int first_pe, int num_pes,
                          size_t heap_bytes, size_t overlap_bytes, uint64_t timeout_ns);
// The sizes of the heap layout for `num_pes` PEs, `ranks_per_node` per node,
// and heaps of `heap_bytes` and `overlap_bytes` (what Initialize() would
// lay out; no GPU needed). Errors: the heaps are too small, limits exceeded.
struct HeapSizes {
  size_t slot_bytes = 0;
  size_t ll_slot_bytes = 0;
  size_t lamport_slot_bytes = 0;  // 0: no Lamport slots (the heap leaves no room)
  size_t overlap_slot_bytes = 0;
};
ffi::Error ComputeHeapLayout(int num_pes, int ranks_per_node, size_t heap_bytes,
                             size_t overlap_bytes, HeapSizes* out);
// The start-up step Initialize() is in, or reached last ("initialised").
const char* InitStage();
// A fresh NVSHMEM unique id (128 bytes), made on the process that will be PE 0.
ffi::Error GetUniqueId(std::string* out);
// Frees the heaps (and finalises NVSHMEM); a no-op when not initialised. Every
// driven GPU finishes its work before anything is freed; every release runs, and
// the first failure (which GPU, which call) is returned. The runtime is down
// afterwards either way.
ffi::Error Finalize();
// Waits until every driven GPU has finished its work; the first failure (which
// GPU, which call). Python's finalize() runs it before the processes meet, so
// that a GPU that cannot finish keeps every process out of NVSHMEM's collective
// shutdown (Finalize() also skips it on the failing process).
ffi::Error Synchronize();
// The runtime of the GPU with CUDA ordinal `device` (not initialised for a
// GPU the runtime does not drive); State() is the first driven GPU's.
const RuntimeState& State(int device);
const RuntimeState& State();
// The runtime's mode, and the number of GPUs it drives in this process.
Mode RuntimeMode();
int NumLocalDevices();
// A call that failed on the host after it had enqueued part of its work (CUDA
// refused a launch or copy half-way): this PE's epochs are then out of step with
// its peers', so every later call of the runtime is refused with `what` (the
// peers' waits time out: they name this PE). Cleared by Finalize().
void RecordBrokenCall(const std::string& what);
// What RecordBrokenCall recorded, or an empty string.
std::string BrokenCall();
// The record of a device wait that timed out on any GPU of this process, or
// code 0; `pe` receives the PE whose wait timed out.
DeviceError LastDeviceError(int* pe = nullptr);
// ffi::Error describing `e`, recorded on PE `pe` (code must be non-zero).
ffi::Error DeviceErrorToFfi(const DeviceError& e, int pe);
// The checks every handler makes before it enqueues anything: the runtime
// drives GPU `device` (XLA's device ordinal of the call), no device wait timed
// out, and XLA's `stream` is on that GPU (queried only when the stream is not
// being captured into a graph). Messages start with `op`.
ffi::Error CheckExecution(const char* op, cudaStream_t stream, int device);

}  // namespace jaxoverlap

#endif  // JAXOVERLAP_RUNTIME_H_
