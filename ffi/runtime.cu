// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The runtime: NVSHMEM bootstrap by unique id (one GPU per process), or the
// in-process runtime (one process, several GPUs of a node, peer access), and
// the symmetric heap of each GPU. This file is compiled by nvcc with
// relocatable device code: NVSHMEM's initialisation sets up the device state
// of the module that calls it, so the call must live in the same
// device-linked library as the kernels.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/check.h"
#include "jaxoverlap/gemm.h"
#include "jaxoverlap/overlap.h"
#include "jaxoverlap/runtime.h"

namespace jaxoverlap {

namespace {

RuntimeState g_states[kMaxDevices];  // by CUDA ordinal
Mode g_mode = Mode::kNone;
int g_devices[kMaxDevices];           // the driven GPUs, in local-rank order
int g_num_devices = 0;
const RuntimeState g_none;            // what State(d) returns for a GPU not driven

// The start-up step in progress (InitStage), so that a start-up that does not
// return can say where it stopped; JAXOVERLAP_DEBUG=1 also prints each step.
std::atomic<const char*> g_init_stage{"not started"};
// RecordBrokenCall's message (empty: none), under its mutex.
std::mutex g_broken_mu;
std::string g_broken_call;

void DebugStep(const char* step) {
  g_init_stage.store(step);
  static const bool enabled = std::getenv("JAXOVERLAP_DEBUG") != nullptr;
  if (enabled) std::fprintf(stderr, "jaxoverlap runtime: %s\n", step);
}

ffi::Error Fail(ffi::ErrorCode code, const std::string& msg) { return ffi::Error(code, msg); }

// The watchdog: a detached host thread that polls the mapped DeviceError of
// every driven GPU and prints it to stderr as soon as a device wait records a
// timeout. The trapped kernel reaches the user only as XLA's
// CUDA_ERROR_LAUNCH_FAILED, so this line is what names the op, rank, peer and
// step. Finalize() stops it (and waits for it) before the memory is freed.
std::atomic<bool> g_watchdog_stop{false};
std::atomic<bool> g_watchdog_running{false};
std::atomic<bool> g_error_printed{false};

DeviceError ReadDeviceError(const DeviceError* host) {
  // Volatile reads: the device writes this memory behind the compiler's back.
  const volatile DeviceError* v = host;
  DeviceError e;
  e.code = v->code;
  e.rank = v->rank;
  e.peer_pe = v->peer_pe;
  e.step = v->step;
  e.block = v->block;
  e.op = v->op;
  e.epoch = v->epoch;
  e.seen = v->seen;
  e.claim = v->claim;
  e.wait = v->wait;
  return e;
}

void WatchdogLoop() {
  while (!g_watchdog_stop.load()) {
    int pe = -1;
    if (LastDeviceError(&pe).code != 0) {
      // Give the device a moment to finish writing the record, then report.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const DeviceError e = LastDeviceError(&pe);
      if (!g_error_printed.exchange(true)) {
        std::fprintf(stderr, "%s\n", DeviceErrorToFfi(e, pe).message().c_str());
        std::fflush(stderr);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  g_watchdog_running.store(false);
}

void StartWatchdog() {
  g_watchdog_stop.store(false);
  g_error_printed.store(false);
  g_watchdog_running.store(true);
  std::thread(WatchdogLoop).detach();
}

void StopWatchdog() {
  g_watchdog_stop.store(true);
  for (int i = 0; i < 500 && g_watchdog_running.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The heap layout (runtime.h), the same on every PE.
struct Layout {
  size_t flag_bytes = 0, ll_slot_bytes = 0, ll_bytes = 0, slot_bytes = 0;
  size_t lamport_slot_bytes = 0, lamport_bytes = 0;
  size_t oflag_bytes = 0, oack_bytes = 0, overlap_slot_bytes = 0;
};

// Heap sizes are multiples of this: the fused ops' region starts at heap_bytes,
// and its 64-bit flags and 16-byte vectors need the alignment
// (jaxoverlap/runtime.py checks it first).
constexpr size_t kHeapAlignment = 256;

// Every device wait is bounded by the timeout: 0 would trap each wait that does
// not succeed at once. The range of jaxoverlap/runtime.py's timeout_s, in ns.
constexpr uint64_t kMinTimeoutNs = 1000000, kMaxTimeoutNs = 1000000000000000000ull;

ffi::Error CheckTimeout(uint64_t timeout_ns) {
  if (timeout_ns < kMinTimeoutNs || timeout_ns > kMaxTimeoutNs) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "timeout_ns " + std::to_string(timeout_ns) + " is outside [" +
                    std::to_string(kMinTimeoutNs) + ", " + std::to_string(kMaxTimeoutNs) +
                    "] (1 ms to 1e9 s)");
  }
  return ffi::Error::Success();
}

ffi::Error MakeLayout(int num_pes, int ranks_per_node, size_t heap_bytes, size_t overlap_bytes,
                      Layout* out) {
  if (num_pes < 1) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "the heap layout needs at least 1 PE, got " + std::to_string(num_pes));
  }
  if (heap_bytes % kHeapAlignment != 0 || overlap_bytes % kHeapAlignment != 0) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "heap sizes must be multiples of " + std::to_string(kHeapAlignment) +
                    " bytes, got heap " + std::to_string(heap_bytes) + " and fused-op heap " +
                    std::to_string(overlap_bytes));
  }
  if (num_pes > kMaxPes) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                std::to_string(num_pes) + " PEs exceed the " + std::to_string(kMaxPes) +
                    " this heap layout supports");
  }
  if (ranks_per_node < 1 || num_pes % ranks_per_node != 0) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "ranks_per_node " + std::to_string(ranks_per_node) + " does not divide " +
                    std::to_string(num_pes) + " PEs");
  }
  if (ranks_per_node > kMaxGroupSize) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "ranks_per_node " + std::to_string(ranks_per_node) + " exceeds the " +
                    std::to_string(kMaxGroupSize) + " GPUs per node this build supports");
  }
  auto round_up = [](size_t v) { return (v + 255) / 256 * 256; };
  Layout l;
  const size_t per_pe_slots = static_cast<size_t>(kNumParities) * kNumPhases * num_pes;
  l.flag_bytes = round_up(sizeof(uint64_t) * per_pe_slots * kMaxBlocks);
  l.ll_slot_bytes = heap_bytes / (4 * per_pe_slots) / (64 * 1024) * (64 * 1024);
  l.ll_slot_bytes = std::min(kMaxLlSlotBytes, std::max(kMinLlSlotBytes, l.ll_slot_bytes));
  l.ll_bytes = per_pe_slots * l.ll_slot_bytes;
  const size_t base_fixed = l.flag_bytes + l.ll_bytes + 2 * l.ll_slot_bytes;
  // acc (2 x S) and the payload slots (per_pe_slots x S) share the rest.
  const size_t min_slot = 64 * 1024;
  const size_t base_need = base_fixed + (per_pe_slots + 2) * min_slot;
  if (heap_bytes < base_need) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "symmetric heap of " + std::to_string(heap_bytes) + " bytes is too small for " +
                    std::to_string(num_pes) + " PEs; it needs at least " +
                    std::to_string(base_need) + " bytes");
  }
  // Lamport slots: heap / 8 over them, within bounds, and at most half of what
  // the other slots' minimum leaves; none where that is below the minimum
  // (protocol lamport then says the heap is too small), so that no job that
  // started before they existed is refused now.
  const size_t lamport_slots =
      static_cast<size_t>(kNumParities) * kNumLamportPhases * ranks_per_node;
  l.lamport_slot_bytes = std::min({kMaxLamportSlotBytes, heap_bytes / (8 * lamport_slots),
                                   (heap_bytes - base_need) / (2 * lamport_slots)}) /
                         (64 * 1024) * (64 * 1024);
  if (l.lamport_slot_bytes < kMinLamportSlotBytes) l.lamport_slot_bytes = 0;
  l.lamport_bytes = lamport_slots * l.lamport_slot_bytes;
  const size_t fixed = base_fixed + l.lamport_bytes;
  l.slot_bytes = (heap_bytes - fixed) / (per_pe_slots + 2) / 256 * 256;
  // The fused ops' region: flags, acks, then ranks_per_node + 1 payload slots
  // (one per sender on this node; this PE's own index and the extra one are
  // its staging buffers).
  l.oflag_bytes = round_up(sizeof(uint64_t) * kMaxGroupSize * kNumOverlapPhases * kMaxChunks);
  l.oack_bytes = round_up(sizeof(uint64_t) * kMaxGroupSize);
  const size_t need = l.oflag_bytes + l.oack_bytes + (ranks_per_node + 1) * min_slot;
  if (overlap_bytes < need) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "fused-op heap of " + std::to_string(overlap_bytes) + " bytes is too small for " +
                    std::to_string(ranks_per_node) + " GPUs per node; it needs at least " +
                    std::to_string(need) + " bytes");
  }
  l.overlap_slot_bytes =
      (overlap_bytes - l.oflag_bytes - l.oack_bytes) / (ranks_per_node + 1) / 256 * 256;
  *out = l;
  return ffi::Error::Success();
}

// Sets up one GPU's state around its heap (symmetric, `heap_bytes +
// overlap_bytes` long, already allocated): zeroed flags, device counters,
// the comm stream and events, cuBLASLt and the error record. The current
// device must be `device`.
ffi::Error SetUpDevice(RuntimeState& st, Mode mode, int device, char* heap, const Layout& l,
                       int pe, int num_pes, int ranks_per_node, size_t heap_bytes,
                       size_t overlap_bytes, uint64_t timeout_ns) {
  DebugStep("device buffers");
  // Flags start at zero; epochs start at 1, so no flag matches before its call.
  // LL8 cells start with a flag of the other parity than their slot's (the
  // even slots, the first half, 0x01010101; the odd ones 0), which no call
  // expects there (all_reduce.cu, "period end"), whatever the count starts at.
  // Lamport slots start empty (every word kLamportEmpty, all_reduce.cu).
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(heap, 0, l.flag_bytes));
  char* ll = heap + l.flag_bytes;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(ll, 0x01, l.ll_bytes / 2));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(ll + l.ll_bytes / 2, 0, l.ll_bytes / 2));
  // Testing only: every cell stale as if left 2^32 calls earlier with the
  // flags of the first calls after the wrap (0 in the even slots, 1 in the odd)
  // and NaN data, so that a call at those flags that took such a cell as new
  // returns NaN (tests/gpu/test_gpu_flag_wrap.py, with JAXOVERLAP_TEST_PAIR_EPOCH).
  if (const char* stale = std::getenv("JAXOVERLAP_TEST_LL_STALE");
      stale != nullptr && std::string(stale) == "1") {
    const size_t words = l.ll_bytes / 2 / sizeof(uint32_t);
    for (uint32_t parity = 0; parity < 2; ++parity) {
      std::vector<uint32_t> cells(words);
      for (size_t i = 0; i < words; ++i) cells[i] = i % 2 == 0 ? 0x7fc07fc0u : parity;
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemcpy(ll + parity * (l.ll_bytes / 2), cells.data(),
                                                 l.ll_bytes / 2, cudaMemcpyHostToDevice));
    }
  }
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMemset(heap + l.flag_bytes + l.ll_bytes, 0xff, l.lamport_bytes));
  char* overlap = heap + heap_bytes;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(overlap, 0, l.oflag_bytes + l.oack_bytes));
  st.mode = mode;
  st.heap = heap;
  st.flags = reinterpret_cast<uint64_t*>(heap);
  st.ll = heap + l.flag_bytes;
  st.lamport = st.ll + l.ll_bytes;
  st.lamport_slot_bytes = l.lamport_slot_bytes;
  char* scratch = st.lamport + l.lamport_bytes;
  st.stage[0] = scratch;
  st.stage[1] = scratch + l.ll_slot_bytes;
  st.acc[0] = scratch + 2 * l.ll_slot_bytes;
  st.ll_slot_bytes = l.ll_slot_bytes;
  st.acc[1] = st.acc[0] + l.slot_bytes;
  st.data = st.acc[1] + l.slot_bytes;
  st.slot_bytes = l.slot_bytes;
  st.acc_bytes = l.slot_bytes;
  st.ranks_per_node = ranks_per_node;
  st.overlap_bytes = overlap_bytes;
  st.overlap_slot_bytes = l.overlap_slot_bytes;
  st.oflags = reinterpret_cast<uint64_t*>(overlap);
  st.oacks = reinterpret_cast<uint64_t*>(overlap + l.oflag_bytes);
  st.oslots = overlap + l.oflag_bytes + l.oack_bytes;
  // Tests on one host use this to take the network path (NVSHMEM puts) across
  // emulated nodes, as on a real cluster where peers are not load/store-reachable.
  const char* force_put = std::getenv("JAXOVERLAP_FORCE_NVSHMEM_PUT");
  st.force_put = force_put != nullptr && std::string(force_put) == "1";
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.pair_epochs, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(st.pair_epochs, 0, sizeof(uint64_t) * num_pes));
  // Testing only (the same value on every PE): start every pair's call count
  // here instead of 0, to reach the 32-bit LL flags' wrap in a few calls.
  if (const char* start = std::getenv("JAXOVERLAP_TEST_PAIR_EPOCH")) {
    const std::vector<uint64_t> epochs(num_pes, std::strtoull(start, nullptr, 10));
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemcpy(st.pair_epochs, epochs.data(),
                                               sizeof(uint64_t) * num_pes,
                                               cudaMemcpyHostToDevice));
  }
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.done_counter, 2 * sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(st.done_counter, 0, 2 * sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.overlap_epochs, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMemset(st.overlap_epochs, 0, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.call_epochs, sizeof(uint64_t) * kMaxGroupSize));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMemset(st.call_epochs, 0, sizeof(uint64_t) * kMaxGroupSize));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.put_counter, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(st.put_counter, 0, sizeof(unsigned int)));
  int least_priority = 0, greatest_priority = 0;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(
      &st.comm_stream, cudaStreamNonBlocking, greatest_priority));
  for (cudaEvent_t& ev : st.events) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  DebugStep("cuBLASLt");
  JAXOVERLAP_RETURN_IF_ERROR(gemm::Init(device));
  DebugStep("kernels");  // loaded now, not lazily next to a waiting kernel (gemm::Preload)
  JAXOVERLAP_RETURN_IF_ERROR(all_reduce::PreloadKernels());
  JAXOVERLAP_RETURN_IF_ERROR(overlap::PreloadKernels());
  JAXOVERLAP_RETURN_IF_ERROR(all_reduce::LamportBlocksPerSm(&st.lamport_blocks_per_sm));
  JAXOVERLAP_RETURN_IF_ERROR(all_reduce::NormClustersAtOnce(st.norm_clusters_at_once));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&st.error_host, sizeof(DeviceError), cudaHostAllocMapped));
  std::memset(st.error_host, 0, sizeof(DeviceError));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.error_device), st.error_host, 0));
  st.my_pe = pe;
  st.num_pes = num_pes;
  st.device = device;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&st.num_sms, cudaDevAttrMultiProcessorCount, device));
  st.heap_bytes = heap_bytes;
  st.timeout_ns = timeout_ns;
  return ffi::Error::Success();
}

// Frees what SetUpDevice made on GPU `device` (also after it failed part way:
// only what exists), and the heap where the runtime allocated it (the peer
// mode's; NVSHMEM's is freed collectively). The GPU's work must have finished.
// Every release runs; the first failure is returned. `st` is reset.
ffi::Error TearDownDevice(RuntimeState& st, int device, char* peer_heap) {
  FirstError first;
  const std::string on = " (GPU " + std::to_string(device) + ")";
  first.Cuda(cudaSetDevice(device), "cudaSetDevice" + on);
  for (void* p : {static_cast<void*>(st.pair_epochs), static_cast<void*>(st.done_counter),
                  static_cast<void*>(st.overlap_epochs), static_cast<void*>(st.call_epochs),
                  static_cast<void*>(st.put_counter)}) {
    if (p != nullptr) first.Cuda(cudaFree(p), "cudaFree (runtime counters)" + on);
  }
  for (cudaEvent_t ev : st.events) {
    if (ev != nullptr) first.Cuda(cudaEventDestroy(ev), "cudaEventDestroy" + on);
  }
  if (st.comm_stream != nullptr) {
    first.Cuda(cudaStreamDestroy(st.comm_stream), "cudaStreamDestroy (comm stream)" + on);
  }
  if (st.error_host != nullptr) first.Cuda(cudaFreeHost(st.error_host), "cudaFreeHost" + on);
  if (peer_heap != nullptr) first.Cuda(cudaFree(peer_heap), "cudaFree (heap)" + on);
  st = RuntimeState();
  return first.Take();
}

// A start-up is running: set by StartUp for the duration of Initialize or
// InitializePeer. Python bounds its wait for one (runtime.py) and may give up
// while it still runs; another must not start beside it.
std::atomic<bool> g_starting{false};

class StartUp {
 public:
  ffi::Error Begin() {
    // Claimed first, then the mode checked: a start-up that ends between the two
    // cannot be followed by a second one over the live runtime.
    bool expected = false;
    if (!g_starting.compare_exchange_strong(expected, true)) {
      return Fail(ffi::ErrorCode::kFailedPrecondition,
                  std::string("another start-up of the jaxoverlap runtime is still running in "
                              "this process (at step '") +
                      g_init_stage.load() +
                      "'; an initialize() that gave up waiting leaves it running); it must "
                      "end first");
    }
    owner_ = true;
    if (g_mode != Mode::kNone) {
      return Fail(ffi::ErrorCode::kFailedPrecondition,
                  "jaxoverlap runtime is already initialised in this process (" +
                      std::to_string(g_num_devices) + " GPU(s), first PE " +
                      std::to_string(State().my_pe) + ")");
    }
    return ffi::Error::Success();
  }
  ~StartUp() {
    if (owner_) g_starting.store(false);
  }

 private:
  bool owner_ = false;
};

}  // namespace

const char* OpName(int32_t op) {
  switch (static_cast<OpId>(op)) {
    case OpId::kAllReduce: return "all_reduce";
    case OpId::kAllGatherMatmul: return "all_gather_matmul";
    case OpId::kMatmulReduceScatter: return "matmul_reduce_scatter";
    case OpId::kMatmulAllReduce: return "matmul_all_reduce";
    case OpId::kAllReduceRmsNorm: return "all_reduce_rms_norm";
    case OpId::kAllReduceReduceScatterStage: return "all_reduce (intra-node reduce-scatter)";
    case OpId::kAllReduceAllGatherStage: return "all_reduce (intra-node all-gather)";
    case OpId::kUnknown: break;
  }
  return "a jaxoverlap op";
}

const RuntimeState& State(int device) {
  if (device < 0 || device >= kMaxDevices) return g_none;
  return g_states[device];
}

const RuntimeState& State() { return g_num_devices > 0 ? g_states[g_devices[0]] : g_none; }

Mode RuntimeMode() { return g_mode; }

int NumLocalDevices() { return g_num_devices; }

const char* InitStage() { return g_init_stage.load(); }

ffi::Error GetUniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  JAXOVERLAP_NVSHMEM_RETURN_IF_ERROR(nvshmemx_get_uniqueid(&id));
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return ffi::Error::Success();
}

ffi::Error ComputeHeapLayout(int num_pes, int ranks_per_node, size_t heap_bytes,
                             size_t overlap_bytes, HeapSizes* out) {
  Layout l;
  JAXOVERLAP_RETURN_IF_ERROR(MakeLayout(num_pes, ranks_per_node, heap_bytes, overlap_bytes, &l));
  out->slot_bytes = l.slot_bytes;
  out->ll_slot_bytes = l.ll_slot_bytes;
  out->lamport_slot_bytes = l.lamport_slot_bytes;
  out->overlap_slot_bytes = l.overlap_slot_bytes;
  return ffi::Error::Success();
}

ffi::Error Initialize(const std::string& unique_id, int rank, int num_ranks, int device,
                      size_t heap_bytes, size_t overlap_bytes, uint64_t timeout_ns,
                      int ranks_per_node) {
  StartUp start_up;
  JAXOVERLAP_RETURN_IF_ERROR(start_up.Begin());
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "NVSHMEM unique id has " + std::to_string(unique_id.size()) +
                    " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckTimeout(timeout_ns));
  if (rank < 0 || rank >= num_ranks) {
    return Fail(ffi::ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) +
                                                      " is outside [0, " +
                                                      std::to_string(num_ranks) + ")");
  }
  if (device < 0 || device >= kMaxDevices) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "CUDA device " + std::to_string(device) + " is outside [0, " +
                    std::to_string(kMaxDevices) + ")");
  }
  Layout layout;
  JAXOVERLAP_RETURN_IF_ERROR(
      MakeLayout(num_ranks, ranks_per_node, heap_bytes, overlap_bytes, &layout));

  DebugStep("cudaSetDevice");
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));

  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  JAXOVERLAP_NVSHMEM_RETURN_IF_ERROR(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr));
  // nvshmemx_init_attr() exits the process on failure; call what it wraps so
  // that a failure becomes a Python error instead.
  nvshmemx_init_init_attr_ver_only(attr);
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  DebugStep("nvshmemi_init_thread (NVSHMEM's bootstrap: every PE must reach it)");
  int provided = 0;
  int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                    NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0) {
    return Fail(ffi::ErrorCode::kInternal,
                "NVSHMEM initialisation failed with status " + std::to_string(status) +
                    " (rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) +
                    ", device " + std::to_string(device) +
                    "); NVSHMEM_DEBUG=INFO shows why");
  }
  DebugStep("nvshmem_my_pe");
  const int my_pe = nvshmem_my_pe();
  const int num_pes = nvshmem_n_pes();
  if (my_pe != rank || num_pes != num_ranks) {
    return Fail(ffi::ErrorCode::kInternal,
                "NVSHMEM gave PE " + std::to_string(my_pe) + " of " + std::to_string(num_pes) +
                    ", expected " + std::to_string(rank) + " of " + std::to_string(num_ranks));
  }

  DebugStep("nvshmem_malloc");
  void* heap = nvshmem_malloc(heap_bytes + overlap_bytes);
  if (heap == nullptr) {
    return Fail(ffi::ErrorCode::kResourceExhausted,
                "nvshmem_malloc(" + std::to_string(heap_bytes + overlap_bytes) +
                    " bytes) failed: the symmetric heap does not fit (NVSHMEM_SYMMETRIC_SIZE, "
                    "or GPU memory left beside XLA's preallocation; lower "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION or the jaxoverlap heap size)");
  }
  RuntimeState& st = g_states[device];
  if (ffi::Error e = SetUpDevice(st, Mode::kNvshmem, device, static_cast<char*>(heap), layout,
                                 my_pe, num_pes, ranks_per_node, heap_bytes, overlap_bytes,
                                 timeout_ns);
      e.failure()) {
    // What this PE made alone is freed (the clean-up's own failures are not
    // reported: `e` is); NVSHMEM's heap and NVSHMEM itself are collective
    // (freeing them would wait for the other PEs) and stay to the process's exit.
    cudaDeviceSynchronize();
    TearDownDevice(st, device, nullptr);
    gemm::Shutdown();
    return e;
  }
  // From here a failure frees what this PE made alone, as above.
  const auto undo = [&](cudaError_t err, const char* what) {
    ffi::Error e = CudaError(err, what, __FILE__, __LINE__);
    TearDownDevice(st, device, nullptr);
    gemm::Shutdown();
    return e;
  };
  if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    return undo(err, "cudaDeviceSynchronize (after setting up the GPU)");
  }
  DebugStep("nvshmem_barrier_all (every PE must have allocated its heap)");
  // Every PE has zeroed its signals before anyone may write them.
  nvshmem_barrier_all();
  if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    return undo(err, "cudaDeviceSynchronize (after NVSHMEM's start-up barrier)");
  }
  st.initialized = true;
  g_devices[0] = device;
  g_num_devices = 1;
  g_mode = Mode::kNvshmem;
  StartWatchdog();
  DebugStep("initialised");
  return ffi::Error::Success();
}

ffi::Error InitializePeer(const int* devices, int num_devices, int first_pe, int num_pes,
                          size_t heap_bytes, size_t overlap_bytes, uint64_t timeout_ns) {
  StartUp start_up;
  JAXOVERLAP_RETURN_IF_ERROR(start_up.Begin());
  if (num_devices < 1 || num_devices > kMaxGroupSize) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "the in-process runtime drives 1 to " + std::to_string(kMaxGroupSize) +
                    " GPUs, got " + std::to_string(num_devices));
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckTimeout(timeout_ns));
  if (first_pe < 0 || first_pe + num_devices > num_pes || first_pe % num_devices != 0) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "PEs " + std::to_string(first_pe) + ".." +
                    std::to_string(first_pe + num_devices - 1) + " are outside the job's " +
                    std::to_string(num_pes) + ", or do not start at a multiple of " +
                    std::to_string(num_devices) + " (one node per process)");
  }
  for (int i = 0; i < num_devices; ++i) {
    if (devices[i] < 0 || devices[i] >= kMaxDevices) {
      return Fail(ffi::ErrorCode::kInvalidArgument,
                  "CUDA device " + std::to_string(devices[i]) + " is outside [0, " +
                      std::to_string(kMaxDevices) + ")");
    }
    for (int j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        return Fail(ffi::ErrorCode::kInvalidArgument,
                    "CUDA device " + std::to_string(devices[i]) + " is listed twice");
      }
    }
  }
  Layout layout;
  JAXOVERLAP_RETURN_IF_ERROR(
      MakeLayout(num_pes, num_devices, heap_bytes, overlap_bytes, &layout));
  // Every pair must reach each other by load/store (NVLink or PCIe peer access).
  DebugStep("peer access");
  for (int i = 0; i < num_devices; ++i) {
    for (int j = 0; j < num_devices; ++j) {
      if (i == j) continue;
      int can = 0;
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, devices[i], devices[j]));
      if (!can) {
        return Fail(ffi::ErrorCode::kFailedPrecondition,
                    "GPU " + std::to_string(devices[i]) + " cannot access GPU " +
                        std::to_string(devices[j]) + "'s memory (cudaDeviceCanAccessPeer is 0: "
                        "no NVLink or PCIe peer access between them); the in-process kernels "
                        "need every pair. Run one process per GPU (NVSHMEM), or backend='xla'");
      }
      JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices[i]));
      const cudaError_t err = cudaDeviceEnablePeerAccess(devices[j], 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA may have enabled it already
      } else {
        JAXOVERLAP_CUDA_RETURN_IF_ERROR(err);
      }
    }
  }
  PeerMap peers;
  peers.in_process = true;
  peers.first_pe = first_pe;
  peers.num_local = num_devices;
  // On a failure, every GPU's heap and state made so far is freed: a retry in
  // this process must not find GiBs taken by this attempt. The clean-up's own
  // failures are not reported: the error that stopped the start-up is.
  auto undo = [&](ffi::Error e) {
    for (int i = 0; i < num_devices; ++i) {
      if (peers.heaps[i] == nullptr) continue;
      cudaSetDevice(devices[i]);
      cudaDeviceSynchronize();
      TearDownDevice(g_states[devices[i]], devices[i], peers.heaps[i]);
    }
    gemm::Shutdown();
    return e;
  };
  for (int i = 0; i < num_devices; ++i) {
    if (const cudaError_t err = cudaSetDevice(devices[i]); err != cudaSuccess) {
      return undo(CudaError(err, "cudaSetDevice", __FILE__, __LINE__));
    }
    DebugStep("cudaMalloc (heap)");
    void* heap = nullptr;
    const cudaError_t err = cudaMalloc(&heap, heap_bytes + overlap_bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return undo(Fail(ffi::ErrorCode::kResourceExhausted,
                       "cudaMalloc(" + std::to_string(heap_bytes + overlap_bytes) +
                           " bytes) of the heap on GPU " + std::to_string(devices[i]) +
                           " failed (" + cudaGetErrorString(err) +
                           "): it does not fit beside XLA's preallocation; lower "
                           "XLA_PYTHON_CLIENT_MEM_FRACTION or the jaxoverlap heap size"));
    }
    peers.heaps[i] = static_cast<char*>(heap);
    RuntimeState& st = g_states[devices[i]];
    if (ffi::Error e = SetUpDevice(st, Mode::kPeer, devices[i], peers.heaps[i], layout,
                                   first_pe + i, num_pes, num_devices, heap_bytes, overlap_bytes,
                                   timeout_ns);
        e.failure()) {
      return undo(std::move(e));
    }
  }
  for (int i = 0; i < num_devices; ++i) {
    if (const cudaError_t err = cudaSetDevice(devices[i]); err != cudaSuccess) {
      return undo(CudaError(err, "cudaSetDevice", __FILE__, __LINE__));
    }
    if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
      return undo(CudaError(err, "cudaDeviceSynchronize (after setting up the GPUs)", __FILE__,
                            __LINE__));
    }
  }
  for (int i = 0; i < num_devices; ++i) {
    RuntimeState& st = g_states[devices[i]];
    st.peers = peers;
    st.peers.self = peers.heaps[i];
    st.initialized = true;
    g_devices[i] = devices[i];
  }
  g_num_devices = num_devices;
  g_mode = Mode::kPeer;
  StartWatchdog();
  DebugStep("initialised");
  return ffi::Error::Success();
}

namespace {

// Every driven GPU finishes its work; the first failure, or success.
ffi::Error SynchronizeDevices(const char* when) {
  FirstError first;
  for (int i = 0; i < g_num_devices; ++i) {
    const std::string on =
        " (GPU " + std::to_string(g_devices[i]) + ", " + std::string(when) + ")";
    first.Cuda(cudaSetDevice(g_devices[i]), "cudaSetDevice" + on);
    first.Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize" + on);
  }
  return first.Take();
}

}  // namespace

ffi::Error Synchronize() { return SynchronizeDevices("before finalize"); }

void RecordBrokenCall(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_broken_mu);
  if (g_broken_call.empty()) g_broken_call = what;
}

std::string BrokenCall() {
  std::lock_guard<std::mutex> lock(g_broken_mu);
  return g_broken_call;
}

ffi::Error Finalize() {
  if (g_mode == Mode::kNone) return ffi::Error::Success();
  StopWatchdog();
  const Mode mode = g_mode;
  FirstError first;
  // Every driven GPU finishes first: a fused op's last AckKernel on one GPU
  // stores into its peers' heaps, which must outlive it.
  ffi::Error synced = SynchronizeDevices("at finalize");
  // A GPU that cannot finish (its context lost) would not take part in
  // NVSHMEM's collective shutdown; NVSHMEM is then left to the process's exit.
  // (Python's finalize() synchronises first and only then meets the other
  // processes, so that they skip it alike.)
  const bool nvshmem_collectives = mode == Mode::kNvshmem && synced.success();
  if (synced.failure() && mode == Mode::kNvshmem) {
    first.Add(Fail(ffi::ErrorCode::kInternal, synced.message() +
                                      "; NVSHMEM's collective shutdown is skipped and left to "
                                      "the process's exit"));
  } else {
    first.Add(std::move(synced));
  }
  if (nvshmem_collectives) {
    first.Cuda(cudaSetDevice(State().device), "cudaSetDevice (at finalize)");
    nvshmem_barrier_all();  // every PE's GPU has finished before any heap goes
    nvshmem_free(State().heap);
  }
  for (int i = 0; i < g_num_devices; ++i) {
    RuntimeState& st = g_states[g_devices[i]];
    first.Add(TearDownDevice(st, g_devices[i], mode == Mode::kPeer ? st.heap : nullptr));
  }
  first.Add(gemm::Shutdown());
  if (nvshmem_collectives) nvshmem_finalize();
  {
    std::lock_guard<std::mutex> lock(g_broken_mu);
    g_broken_call.clear();
  }
  g_num_devices = 0;
  g_mode = Mode::kNone;
  return first.Take();
}

DeviceError LastDeviceError(int* pe) {
  for (int i = 0; i < g_num_devices; ++i) {
    const RuntimeState& st = g_states[g_devices[i]];
    if (st.error_host == nullptr) continue;
    const DeviceError e = ReadDeviceError(st.error_host);
    if (e.code != 0) {
      if (pe != nullptr) *pe = st.my_pe;
      return e;
    }
  }
  return DeviceError{};
}

ffi::Error CheckExecution(const char* op, cudaStream_t stream, int device) {
  const RuntimeState& s = State(device);
  if (!s.initialized) {
    if (g_mode == Mode::kNone) {
      return Fail(ffi::ErrorCode::kFailedPrecondition,
                  std::string(op) + ": jaxoverlap.initialize() has not been called in this "
                                    "process");
    }
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                std::string(op) + ": the runtime does not drive GPU " + std::to_string(device) +
                    " (it drives " + std::to_string(g_num_devices) + " GPU(s) of this process; "
                    "the mesh's devices and jaxoverlap.initialize()'s disagree)");
  }
  int pe = -1;
  const DeviceError last = LastDeviceError(&pe);
  if (last.code != 0) return DeviceErrorToFfi(last, pe);
  if (const std::string broken = BrokenCall(); !broken.empty()) {
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                std::string(op) + ": refused: " + broken);
  }
  // The stream's device cannot be queried while XLA captures a CUDA graph;
  // it is checked on every uncaptured execution.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  int stream_device = s.device;
  if (capture == cudaStreamCaptureStatusNone) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &stream_device));
  }
  if (stream_device != s.device) {
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                std::string(op) + ": XLA's stream is on device " + std::to_string(stream_device) +
                    " but the call is for device " + std::to_string(s.device));
  }
  return ffi::Error::Success();
}

ffi::Error DeviceErrorToFfi(const DeviceError& e, int pe) {
  const std::string peer = std::to_string(e.peer_pe);
  if (e.code == 2) {
    return ffi::Error(
        ffi::ErrorCode::kOutOfRange,
        std::string("jaxoverlap: ") + OpName(e.op) + " stopped on PE " + std::to_string(pe) +
            " (rank " + std::to_string(e.rank) + " of its group): call " +
            std::to_string(e.epoch) + " with peer PE " + peer + " ends a period of the LL "
            "protocol's 32-bit flags, and with JAXOVERLAP_EPOCH_AT_START=1 (a measurement knob) "
            "the kernels advance their call count before they read, so they cannot re-stamp "
            "the cells there as the default kernels do. The GPU context is lost (the kernel "
            "trapped); unset JAXOVERLAP_EPOCH_AT_START and restart the processes.");
  }
  const double timeout_s = static_cast<double>(State().timeout_ns) * 1e-9;
  char timeout[32];
  std::snprintf(timeout, sizeof(timeout), "%g", timeout_s);
  std::string what;  // what the wait polled for, in its own terms (WaitKind)
  switch (static_cast<WaitKind>(e.wait)) {
    case WaitKind::kLLFlag:
      what = "block " + std::to_string(e.block) + ", LL flag " + std::to_string(e.epoch) +
             " (the call count's low 32 bits), flag seen " + std::to_string(e.seen);
      break;
    case WaitKind::kLamportData:
      what = "the range of start ticket " + std::to_string(e.block) + ", call " +
             std::to_string(e.epoch) + ": the Lamport slot still held no data";
      break;
    default:
      what = "block or chunk " + std::to_string(e.block) + ", epoch " +
             std::to_string(e.epoch) + ", signal seen " + std::to_string(e.seen);
  }
  return ffi::Error(
      ffi::ErrorCode::kDeadlineExceeded,
      std::string("jaxoverlap: ") + OpName(e.op) + " timed out on PE " + std::to_string(pe) +
          " (rank " + std::to_string(e.rank) + " of its group): peer PE " + peer +
          " did not arrive at step " + std::to_string(e.step) + " within " + timeout +
          " s (" + what + "). Likely causes: the ranks called the jaxoverlap ops in different "
          "orders, with different sizes or dtypes, or over different groups; or the process of "
          "PE " + peer + " stopped, died or was slower than JAXOVERLAP_TIMEOUT_S. The GPU "
          "context is lost "
          "(XLA reports the trapped kernel as CUDA_ERROR_LAUNCH_FAILED, 'unspecified launch "
          "failure'); restart the processes.");
}

}  // namespace jaxoverlap
