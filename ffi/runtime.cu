// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// NVSHMEM bootstrap by unique id, and the one symmetric heap of the process.
// This file is compiled by nvcc with relocatable device code: NVSHMEM's
// initialisation sets up the device state of the module that calls it, so the
// call must live in the same device-linked library as the kernels.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "jaxoverlap/check.h"
#include "jaxoverlap/runtime.h"

namespace jaxoverlap {

namespace {

RuntimeState g_state;

// JAXOVERLAP_DEBUG=1 prints each start-up step to stderr.
void DebugStep(const char* step) {
  static const bool enabled = std::getenv("JAXOVERLAP_DEBUG") != nullptr;
  if (enabled) std::fprintf(stderr, "jaxoverlap runtime: %s\n", step);
}

ffi::Error Fail(ffi::ErrorCode code, const std::string& msg) { return ffi::Error(code, msg); }

}  // namespace

const RuntimeState& State() { return g_state; }

void SetTimeout(uint64_t timeout_ns) { g_state.timeout_ns = timeout_ns; }

ffi::Error GetUniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  JAXOVERLAP_NVSHMEM_RETURN_IF_ERROR(nvshmemx_get_uniqueid(&id));
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return ffi::Error::Success();
}

ffi::Error Initialize(const std::string& unique_id, int rank, int num_ranks, int device,
                      size_t heap_bytes, uint64_t timeout_ns) {
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
  DebugStep("nvshmemi_init_thread");
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

  // Deterministic layout: signals first, then the data slots.
  const size_t signal_bytes =
      sizeof(uint64_t) * static_cast<size_t>(kNumParities) * num_pes * kMaxBlocks;
  const size_t header = (signal_bytes + 255) / 256 * 256;
  if (heap_bytes < header + static_cast<size_t>(kNumParities) * num_pes * 4096) {
    return Fail(ffi::ErrorCode::kInvalidArgument,
                "symmetric heap of " + std::to_string(heap_bytes) + " bytes is too small for " +
                    std::to_string(num_pes) + " PEs; it needs at least " +
                    std::to_string(header + static_cast<size_t>(kNumParities) * num_pes * 4096));
  }
  size_t slot_bytes = (heap_bytes - header) / (static_cast<size_t>(kNumParities) * num_pes);
  slot_bytes = slot_bytes / 256 * 256;

  DebugStep("nvshmem_malloc");
  void* heap = nvshmem_malloc(heap_bytes);
  if (heap == nullptr) {
    return Fail(ffi::ErrorCode::kResourceExhausted,
                "nvshmem_malloc(" + std::to_string(heap_bytes) +
                    " bytes) failed: the symmetric heap does not fit (NVSHMEM_SYMMETRIC_SIZE, "
                    "or GPU memory left beside XLA's preallocation; lower "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION or the jaxoverlap heap size)");
  }
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(heap, 0, header));

  DebugStep("device buffers");
  g_state.heap = static_cast<char*>(heap);
  g_state.signals = reinterpret_cast<uint64_t*>(g_state.heap);
  g_state.data = g_state.heap + header;
  g_state.slot_bytes = slot_bytes;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&g_state.pair_epochs, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(g_state.pair_epochs, 0, sizeof(uint64_t) * num_pes));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&g_state.done_counter, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMemset(g_state.done_counter, 0, sizeof(unsigned int)));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&g_state.error_host, sizeof(DeviceError), cudaHostAllocMapped));
  std::memset(g_state.error_host, 0, sizeof(DeviceError));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&g_state.error_device), g_state.error_host, 0));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  DebugStep("nvshmem_barrier_all");
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
  cudaFreeHost(g_state.error_host);
  nvshmem_finalize();
  g_state = RuntimeState();
}

DeviceError LastDeviceError() {
  DeviceError e{};
  if (g_state.error_host != nullptr) {
    std::memcpy(&e, const_cast<const DeviceError*>(g_state.error_host), sizeof(e));
  }
  return e;
}

ffi::Error DeviceErrorToFfi(const DeviceError& e) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    "jaxoverlap: a device wait timed out on PE " + std::to_string(g_state.my_pe) +
                        " (rank " + std::to_string(e.rank) + " in its group): peer PE " +
                        std::to_string(e.peer_pe) + " did not arrive at step " +
                        std::to_string(e.step) + " (block " + std::to_string(e.block) +
                        ", epoch " + std::to_string(e.epoch) + ", signal seen " +
                        std::to_string(e.seen) + "); the GPU context is lost");
}

}  // namespace jaxoverlap
