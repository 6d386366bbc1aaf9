// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// A benchmark aid: an FFI custom call that copies its input to its output
// with one kernel launch and no communication. Timed in the same chain as the
// all-reduces, it is the floor that any single-kernel custom call pays inside
// XLA (thunk, command-buffer node, launch), so the benchmarks can say how much
// of an all-reduce's latency is communication.
#include <cuda_runtime.h>

#include <cstdint>

#include "jaxoverlap/check.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace {

__global__ void CopyKernel(const uint4* in, uint4* out, size_t num_vectors, const char* in_tail,
                           char* out_tail, size_t tail_bytes) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_vectors;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < tail_bytes) out_tail[threadIdx.x] = in_tail[threadIdx.x];
}

ffi::Error LaunchFloorExecute(cudaStream_t stream, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  const size_t vectors = bytes / 16;
  const int blocks = static_cast<int>(std::min<size_t>(132, (vectors + 511) / 512 + 1));
  const char* in = static_cast<const char*>(x.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  CopyKernel<<<blocks, 512, 0, stream>>>(reinterpret_cast<const uint4*>(in),
                                         reinterpret_cast<uint4*>(o), vectors, in + vectors * 16,
                                         o + vectors * 16, bytes % 16);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyKernel launch");
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloor, jaxoverlap::LaunchFloorExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>(),  // out: a copy of x
    {xla::ffi::Traits::kCmdBufferCompatible});
