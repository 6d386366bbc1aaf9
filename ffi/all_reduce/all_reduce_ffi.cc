// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI binding of the all-reduce kernels: validates the call, finds this
// PE's group in the `groups` attribute (computed at lowering time from the
// shard_map mesh) and launches the planned algorithm on XLA's stream.
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

ffi::Error AllReduceExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution("all_reduce", stream, device));
  const RuntimeState& s = State(device);
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("all_reduce: output type/shape differs from the input");
  }
  Topology topo;
  JAXOVERLAP_RETURN_IF_ERROR(MakeTopology(attrs.groups.begin(), attrs.groups.size(),
                                          attrs.group_size, s.my_pe, s.num_pes, s.ranks_per_node,
                                          &topo));
  return AllReduce(s, stream, attrs.algorithm, attrs.protocol, x.element_type(),
                   x.untyped_data(), out->untyped_data(), x.element_count(), topo);
}

}  // namespace

}  // namespace jaxoverlap::all_reduce

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapAllReduce, jaxoverlap::all_reduce::AllReduceExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Ctx<xla::ffi::DeviceOrdinal>()  // the GPU of this call (its runtime state)
        .Arg<xla::ffi::AnyBuffer>()   // x: [...] per-rank input, f32/bf16/f16
        .Ret<xla::ffi::AnyBuffer>()   // out: same shape and dtype as x
        .Attrs<jaxoverlap::all_reduce::Attrs>(),  // groups, group_size, algorithm, protocol
    {xla::ffi::Traits::kCmdBufferCompatible});
