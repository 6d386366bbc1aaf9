// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The NVSHMEM runtime of one process: one PE, one GPU, one symmetric heap
// allocated once at start-up and sub-allocated deterministically (every PE
// computes the same layout, so offsets agree without communication).
//
// Heap layout (all symmetric, offsets identical on every PE):
//   signals  [kNumParities][num_pes][kMaxBlocks] uint64   completion flags
//   data     [kNumParities][num_pes][slot_bytes]          one slot per sender
// Slots and signals are indexed by the *sender's* PE and by the parity of the
// per-pair epoch, so a sender can be one call ahead of a receiver without
// overwriting data the receiver still reads (see all_reduce/one_shot.cu).
#ifndef JAXOVERLAP_RUNTIME_H_
#define JAXOVERLAP_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace ffi = xla::ffi;

inline constexpr int kMaxBlocks = 32;     // blocks of one collective kernel
inline constexpr int kNumParities = 2;    // double buffering by epoch parity
inline constexpr int kMaxGroupSize = 8;   // ranks of one intra-node group

// What a timed-out device wait leaves behind, in mapped pinned host memory so
// that the host can read it even after the kernel trapped.
struct DeviceError {
  int32_t code;      // 0: none; 1: wait timed out
  int32_t rank;      // rank (in its group) of the PE that waited
  int32_t peer_pe;   // PE whose signal did not arrive
  int32_t step;      // algorithm step (0: one-shot receive)
  int32_t block;     // block that waited
  int32_t pad;
  uint64_t epoch;    // epoch waited for
  uint64_t seen;     // signal value seen at the timeout
};

struct RuntimeState {
  bool initialized = false;
  int my_pe = -1;
  int num_pes = 0;
  int device = -1;
  size_t heap_bytes = 0;
  size_t slot_bytes = 0;
  uint64_t timeout_ns = 0;
  char* heap = nullptr;              // symmetric, nvshmem_malloc'ed once
  uint64_t* signals = nullptr;       // symmetric, inside heap
  char* data = nullptr;              // symmetric, inside heap
  uint64_t* pair_epochs = nullptr;   // device memory [num_pes]: calls made with each peer
  unsigned int* done_counter = nullptr;  // device memory: blocks finished in the current call
  DeviceError* error_host = nullptr;     // mapped pinned memory
  DeviceError* error_device = nullptr;   // its device alias
};

// Brings NVSHMEM up with a unique id made by PE 0 and exchanged by the caller.
ffi::Error Initialize(const std::string& unique_id, int rank, int num_ranks, int device,
                      size_t heap_bytes, uint64_t timeout_ns);
// A fresh NVSHMEM unique id (128 bytes), made on the process that will be PE 0.
ffi::Error GetUniqueId(std::string* out);
// Frees the heap and finalises NVSHMEM; a no-op when not initialised.
void Finalize();
const RuntimeState& State();
// Sets the device-wait timeout (ns) used by kernels launched after this call.
void SetTimeout(uint64_t timeout_ns);
// The record of a device wait that timed out, or code 0.
DeviceError LastDeviceError();
// ffi::Error describing `e` (code must be non-zero).
ffi::Error DeviceErrorToFfi(const DeviceError& e);

}  // namespace jaxoverlap

#endif  // JAXOVERLAP_RUNTIME_H_
