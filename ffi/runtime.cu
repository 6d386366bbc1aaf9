// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// NVSHMEM bootstrap by unique id, and the one symmetric heap of the process.
// This file is compiled by nvcc with relocatable device code: NVSHMEM's
// initialisation sets up the device state of the module that calls it, so the
// call must live in the same device-linked library as the kernels.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "jaxoverlap/check.h"
#include "jaxoverlap/gemm.h"
#include "jaxoverlap/runtime.h"

namespace jaxoverlap {

namespace {

RuntimeState g_state;

// The start-up step in progress (InitStage), so that a start-up that does not
// return can say where it stopped; JAXOVERLAP_DEBUG=1 also prints each step.
std::atomic<const char*> g_init_stage{"not started"};

void DebugStep(const char* step) {
  g_init_stage.store(step);
  static const bool enabled = std::getenv("JAXOVERLAP_DEBUG") != nullptr;
  if (enabled) std::fprintf(stderr, "jaxoverlap runtime: %s\n", step);
}

ffi::Error Fail(ffi::ErrorCode code, const std::string& msg) { return ffi::Error(code, msg); }

// The watchdog: a detached host thread that polls the mapped DeviceError and
// prints it to stderr as soon as a device wait records a timeout. The trapped
// kernel reaches the user only as XLA's CUDA_ERROR_LAUNCH_FAILED, so this line
// is what names the op, rank, peer and step. Finalize() stops it (and waits
// for it) before the mapped memory is freed.
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
  return e;
}

void WatchdogLoop(const DeviceError* host) {
  while (!g_watchdog_stop.load()) {
    if (ReadDeviceError(host).code != 0) {
      // Give the device a moment to finish writing the record, then report.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const DeviceError e = ReadDeviceError(host);
      if (!g_error_printed.exchange(true)) {
        std::fprintf(stderr, "%s\n", DeviceErrorToFfi(e).message().c_str());
        std::fflush(stderr);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  g_watchdog_running.store(false);
}

void StartWatchdog(const DeviceError* host) {
  g_watchdog_stop.store(false);
  g_error_printed.store(false);
  g_watchdog_running.store(true);
  std::thread(WatchdogLoop, host).detach();
}

void StopWatchdog() {
  g_watchdog_stop.store(true);
  for (int i = 0; i < 500 && g_watchdog_running.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

const char* OpName(int32_t op) {
  switch (static_cast<OpId>(op)) {
    case OpId::kAllReduce: return "all_reduce";
    case OpId::kAllGatherMatmul: return "all_gather_matmul";
    case OpId::kMatmulReduceScatter: return "matmul_reduce_scatter";
    case OpId::kMatmulAllReduce: return "matmul_all_reduce";
    case OpId::kUnknown: break;
  }
  return "a jaxoverlap op";
}

const RuntimeState& State() { return g_state; }

const char* InitStage() { return g_init_stage.load(); }

void SetTimeout(uint64_t timeout_ns) { g_state.timeout_ns = timeout_ns; }

ffi::Error GetUniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  JAXOVERLAP_NVSHMEM_RETURN_IF_ERROR(nvshmemx_get_uniqueid(&id));
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return ffi::Error::Success();
}

ffi::Error Initialize(const std::string& unique_id, int rank, int num_ranks, int device,
                      size_t heap_bytes, size_t overlap_bytes, uint64_t timeout_ns,
                      int ranks_per_node) {
  if (g_state.initialized) {
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                "jaxoverlap runtime is already initialised in this process (PE " +
                    std::to_string(g_state.my_pe) + ")");
  }
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "NVSHMEM unique id has " + std::to_string(unique_id.size()) +
                    " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  }
  if (rank < 0 || rank >= num_ranks) {
    return Fail(ffi::ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) +
                                                      " is outside [0, " +
                                                      std::to_string(num_ranks) + ")");
  }
  if (num_ranks > kMaxPes) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                std::to_string(num_ranks) + " PEs exceed the " + std::to_string(kMaxPes) +
                    " this heap layout supports");
  }
  if (ranks_per_node < 1 || num_ranks % ranks_per_node != 0) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "ranks_per_node " + std::to_string(ranks_per_node) + " does not divide " +
                    std::to_string(num_ranks) + " PEs");
  }
  // Deterministic layout (runtime.h): flags, LL8 cells, scratch, payload slots.
  auto round_up = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t per_pe_slots = static_cast<size_t>(kNumParities) * kNumPhases * num_ranks;
  const size_t flag_bytes = round_up(sizeof(uint64_t) * per_pe_slots * kMaxBlocks);
  size_t ll_slot_bytes = heap_bytes / (4 * per_pe_slots) / (64 * 1024) * (64 * 1024);
  ll_slot_bytes = std::min(kMaxLlSlotBytes, std::max(kMinLlSlotBytes, ll_slot_bytes));
  const size_t ll_bytes = per_pe_slots * ll_slot_bytes;
  const size_t fixed = flag_bytes + ll_bytes + 2 * ll_slot_bytes;
  // acc (2 x S) and the payload slots (per_pe_slots x S) share the rest.
  const size_t min_slot = 64 * 1024;
  if (heap_bytes < fixed + (per_pe_slots + 2) * min_slot) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "symmetric heap of " + std::to_string(heap_bytes) + " bytes is too small for " +
                    std::to_string(num_ranks) + " PEs; it needs at least " +
                    std::to_string(fixed + (per_pe_slots + 2) * min_slot) + " bytes");
  }
  const size_t slot_bytes = (heap_bytes - fixed) / (per_pe_slots + 2) / 256 * 256;
  // The fused ops' region: flags, acks, then ranks_per_node + 1 payload slots
  // (one per sender on this node; this PE's own index and the extra one are
  // its staging buffers).
  const size_t oflag_bytes = round_up(sizeof(uint64_t) * kMaxGroupSize * kNumOverlapPhases * kMaxChunks);
  const size_t oack_bytes = round_up(sizeof(uint64_t) * kMaxGroupSize);
  if (ranks_per_node > kMaxGroupSize) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "ranks_per_node " + std::to_string(ranks_per_node) + " exceeds the " +
                    std::to_string(kMaxGroupSize) + " GPUs per node this build supports");
  }
  if (overlap_bytes < oflag_bytes + oack_bytes + (ranks_per_node + 1) * min_slot) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "fused-op heap of " + std::to_string(overlap_bytes) + " bytes is too small for " +
                    std::to_string(ranks_per_node) + " GPUs per node; it needs at least " +
                    std::to_string(oflag_bytes + oack_bytes + (ranks_per_node + 1) * min_slot) +
                    " bytes");
  }
  const size_t overlap_slot_bytes =
      (overlap_bytes - oflag_bytes - oack_bytes) / (ranks_per_node + 1) / 256 * 256;

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
  // Flags and LL8 cells start at zero; epochs start at 1, so nothing stale matches.
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(heap, 0, flag_bytes + ll_bytes));
  char* overlap = static_cast<char*>(heap) + heap_bytes;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(overlap, 0, oflag_bytes + oack_bytes));

  DebugStep("device buffers");
  g_state.heap = static_cast<char*>(heap);
  g_state.flags = reinterpret_cast<uint64_t*>(g_state.heap);
  g_state.ll = g_state.heap + flag_bytes;
  char* scratch = g_state.ll + ll_bytes;
  g_state.stage[0] = scratch;
  g_state.stage[1] = scratch + ll_slot_bytes;
  g_state.acc[0] = scratch + 2 * ll_slot_bytes;
  g_state.ll_slot_bytes = ll_slot_bytes;
  g_state.acc[1] = g_state.acc[0] + slot_bytes;
  g_state.data = g_state.acc[1] + slot_bytes;
  g_state.slot_bytes = slot_bytes;
  g_state.acc_bytes = slot_bytes;
  g_state.ranks_per_node = ranks_per_node;
  g_state.overlap_bytes = overlap_bytes;
  g_state.overlap_slot_bytes = overlap_slot_bytes;
  g_state.oflags = reinterpret_cast<uint64_t*>(overlap);
  g_state.oacks = reinterpret_cast<uint64_t*>(overlap + oflag_bytes);
  g_state.oslots = overlap + oflag_bytes + oack_bytes;
  // Tests on one host use this to take the network path (NVSHMEM puts) across
  // emulated nodes, as on a real cluster where peers are not load/store-reachable.
  const char* force_put = std::getenv("JAXOVERLAP_FORCE_NVSHMEM_PUT");
  g_state.force_put = force_put != nullptr && std::string(force_put) == "1";
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&g_state.pair_epochs, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(g_state.pair_epochs, 0, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g_state.done_counter, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(g_state.done_counter, 0, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&g_state.overlap_epochs, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMemset(g_state.overlap_epochs, 0, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g_state.call_epochs, sizeof(uint64_t) * kMaxGroupSize));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMemset(g_state.call_epochs, 0, sizeof(uint64_t) * kMaxGroupSize));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g_state.put_counter, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(g_state.put_counter, 0, sizeof(unsigned int)));
  int least_priority = 0, greatest_priority = 0;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(
      &g_state.comm_stream, cudaStreamNonBlocking, greatest_priority));
  for (cudaEvent_t& ev : g_state.events) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  DebugStep("cuBLASLt");
  JAXOVERLAP_RETURN_IF_ERROR(gemm::Init(device));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&g_state.error_host, sizeof(DeviceError), cudaHostAllocMapped));
  std::memset(g_state.error_host, 0, sizeof(DeviceError));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&g_state.error_device), g_state.error_host, 0));
  StartWatchdog(g_state.error_host);
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  DebugStep("nvshmem_barrier_all (every PE must have allocated its heap)");
  // Every PE has zeroed its signals before anyone may write them.
  nvshmem_barrier_all();
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());

  g_state.my_pe = my_pe;
  g_state.num_pes = num_pes;
  g_state.device = device;
  g_state.heap_bytes = heap_bytes;
  g_state.timeout_ns = timeout_ns;
  g_state.initialized = true;
  DebugStep("initialised");
  return ffi::Error::Success();
}

void Finalize() {
  if (!g_state.initialized) return;
  cudaSetDevice(g_state.device);
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g_state.heap);
  cudaFree(g_state.pair_epochs);
  cudaFree(g_state.done_counter);
  cudaFree(g_state.overlap_epochs);
  cudaFree(g_state.call_epochs);
  cudaFree(g_state.put_counter);
  for (cudaEvent_t ev : g_state.events) cudaEventDestroy(ev);
  cudaStreamDestroy(g_state.comm_stream);
  gemm::Shutdown();
  StopWatchdog();
  cudaFreeHost(g_state.error_host);
  nvshmem_finalize();
  g_state = RuntimeState();
}

DeviceError LastDeviceError() {
  if (g_state.error_host == nullptr) return DeviceError{};
  return ReadDeviceError(g_state.error_host);
}

ffi::Error CheckExecution(const char* op, cudaStream_t stream) {
  if (!g_state.initialized) {
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                std::string(op) + ": jaxoverlap.initialize() has not been called in this process");
  }
  const DeviceError last = LastDeviceError();
  if (last.code != 0) return DeviceErrorToFfi(last);
  // The stream's device cannot be queried while XLA captures a CUDA graph;
  // it is checked on every uncaptured execution.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  int stream_device = g_state.device;
  if (capture == cudaStreamCaptureStatusNone) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &stream_device));
  }
  if (stream_device != g_state.device) {
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                std::string(op) + ": XLA's stream is on device " + std::to_string(stream_device) +
                    " but NVSHMEM was initialised on device " + std::to_string(g_state.device));
  }
  return ffi::Error::Success();
}

ffi::Error DeviceErrorToFfi(const DeviceError& e) {
  const std::string peer = std::to_string(e.peer_pe);
  const double timeout_s = static_cast<double>(g_state.timeout_ns) * 1e-9;
  char timeout[32];
  std::snprintf(timeout, sizeof(timeout), "%g", timeout_s);
  return ffi::Error(
      ffi::ErrorCode::kDeadlineExceeded,
      std::string("jaxoverlap: ") + OpName(e.op) + " timed out on PE " +
          std::to_string(g_state.my_pe) + " (rank " + std::to_string(e.rank) +
          " of its group): peer PE " + peer + " did not arrive at step " +
          std::to_string(e.step) + " within " + timeout + " s (block or chunk " +
          std::to_string(e.block) + ", epoch " + std::to_string(e.epoch) + ", signal seen " +
          std::to_string(e.seen) + "). Likely causes: the ranks called the jaxoverlap ops in "
          "different orders, with different sizes or dtypes, or over different groups; or the "
          "process of PE " + peer + " stopped, died or was slower than JAXOVERLAP_TIMEOUT_S. The "
          "GPU context is lost (XLA reports the trapped kernel as CUDA_ERROR_LAUNCH_FAILED, "
          "'unspecified launch failure'); restart the processes.");
}

}  // namespace jaxoverlap
