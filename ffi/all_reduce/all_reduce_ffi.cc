// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI binding of the all-reduce kernels: validates the call, finds this
// PE's group in the `groups` attribute (computed at lowering time from the
// shard_map mesh) and launches the chosen algorithm on XLA's stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/check.h"
#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::all_reduce {

namespace ffi = xla::ffi;

namespace {

// Finds the group holding this PE. `groups` is [num_groups * group_size] PEs,
// each group in rank order (like an HLO replica_groups attribute).
ffi::Error FindGroup(ffi::Span<const int64_t> groups, int64_t group_size, int my_pe, Group* g) {
  if (group_size < 1 || group_size > kMaxGroupSize) {
    return ffi::Error::InvalidArgument("all_reduce: group size " + std::to_string(group_size) +
                                       " is not supported (1.." +
                                       std::to_string(kMaxGroupSize) + ")");
  }
  if (groups.size() % group_size != 0) {
    return ffi::Error::InvalidArgument("all_reduce: groups attribute has " +
                                       std::to_string(groups.size()) +
                                       " entries, not a multiple of group size " +
                                       std::to_string(group_size));
  }
  const int num_pes = State().num_pes;
  for (size_t start = 0; start < groups.size(); start += group_size) {
    for (int64_t r = 0; r < group_size; ++r) {
      if (groups[start + r] != my_pe) continue;
      g->rank = static_cast<int>(r);
      g->num_ranks = static_cast<int>(group_size);
      for (int64_t q = 0; q < group_size; ++q) {
        const int64_t pe = groups[start + q];
        if (pe < 0 || pe >= num_pes) {
          return ffi::Error::InvalidArgument("all_reduce: group names PE " + std::to_string(pe) +
                                             " but NVSHMEM has " + std::to_string(num_pes) +
                                             " PEs");
        }
        g->pes[q] = static_cast<int>(pe);
      }
      return ffi::Error::Success();
    }
  }
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "all_reduce: PE " + std::to_string(my_pe) +
                        " is in none of the groups of this call; the mesh's devices and the "
                        "NVSHMEM PEs disagree (one process per GPU, PE = jax.process_index())");
}

ffi::Error AllReduceExecute(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                            int64_t group_size, int64_t algorithm) {
  const RuntimeState& s = State();
  if (!s.initialized) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "all_reduce: jaxoverlap.initialize() has not been called in this process");
  }
  const DeviceError last = LastDeviceError();
  if (last.code != 0) return DeviceErrorToFfi(last);
  // The stream's device cannot be queried while XLA captures a CUDA graph;
  // it is checked on every uncaptured execution.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  int stream_device = s.device;
  if (capture == cudaStreamCaptureStatusNone) {
    JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &stream_device));
  }
  if (stream_device != s.device) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "all_reduce: XLA's stream is on device " + std::to_string(stream_device) +
                          " but NVSHMEM was initialised on device " + std::to_string(s.device));
  }
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("all_reduce: output type/shape differs from the input");
  }
  Group g;
  JAXOVERLAP_RETURN_IF_ERROR(FindGroup(groups, group_size, s.my_pe, &g));
  switch (static_cast<Algorithm>(algorithm)) {
    case Algorithm::kOneShot:
      return OneShot(stream, x.element_type(), x.untyped_data(), out->untyped_data(),
                     x.element_count(), g);
  }
  return ffi::Error::InvalidArgument("all_reduce: unknown algorithm id " +
                                     std::to_string(algorithm));
}

}  // namespace

}  // namespace jaxoverlap::all_reduce

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapAllReduce, jaxoverlap::all_reduce::AllReduceExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] per-rank input, f32/bf16/f16
        .Ret<xla::ffi::AnyBuffer>()   // out: same shape and dtype as x
        .Attr<xla::ffi::Span<const int64_t>>("groups")  // [num_groups * group_size] PEs
        .Attr<int64_t>("group_size")  // ranks per group (the shard_map axis size)
        .Attr<int64_t>("algorithm"),  // Algorithm enum value
    {xla::ffi::Traits::kCmdBufferCompatible});
