// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// A benchmark aid: an FFI custom call that copies its input to its output
// with one kernel launch and no communication. Timed in the same chain as the
// all-reduces, it is the floor that any single-kernel custom call pays inside
// XLA (thunk, command-buffer node, launch), so the benchmarks can say how much
// of an all-reduce's latency is communication.
//
// The "_pdl" twin launches the same kernel with programmatic dependent launch
// (Hopper; cudaLaunchAttributeProgrammaticStreamSerialization): the kernel may
// be scheduled while the kernel before it in the stream is still finishing,
// and waits (griddepcontrol.wait) for that kernel's completion and memory
// before its first load. benchmarks/launch_floor_pdl.py times the two, to see
// what PDL would save the collectives' kernels inside XLA's graphs.
#include <cuda_runtime.h>

#include <cstdint>

#include "jaxoverlap/check.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace {

template <bool kPdl>
__global__ void CopyKernel(const uint4* in, uint4* out, size_t num_vectors, const char* in_tail,
                           char* out_tail, size_t tail_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // PDL is Hopper's; a plain launch before it
  if constexpr (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_vectors;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < tail_bytes) out_tail[threadIdx.x] = in_tail[threadIdx.x];
}

template <bool kPdl>
ffi::Error LaunchFloorExecute(cudaStream_t stream, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> out) {
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
  config.numAttrs = kPdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(
      &config, CopyKernel<kPdl>, reinterpret_cast<const uint4*>(in), reinterpret_cast<uint4*>(o),
      vectors, in + vectors * 16, o + vectors * 16, bytes % 16);
  if (err != cudaSuccess) return CudaError(err, "CopyKernel launch", __FILE__, __LINE__);
  JAXOVERLAP_RETURN_IF_LAUNCH_ERROR("CopyKernel launch");
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloor, jaxoverlap::LaunchFloorExecute<false>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>(),  // out: a copy of x
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapLaunchFloorPdl, jaxoverlap::LaunchFloorExecute<true>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] any dtype
        .Ret<xla::ffi::AnyBuffer>(),  // out: a copy of x
    {xla::ffi::Traits::kCmdBufferCompatible});
