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

ffi::Error AllReduceExecute(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                            int64_t group_size, int64_t algorithm, int64_t protocol) {
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution("all_reduce", stream));
  const RuntimeState& s = State();
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("all_reduce: output type/shape differs from the input");
  }
  if (algorithm < 1 || algorithm > 3 || protocol < 0 || protocol > 2) {
    return ffi::Error::InvalidArgument("all_reduce: unknown algorithm id " +
                                       std::to_string(algorithm) + " or protocol id " +
                                       std::to_string(protocol));
  }
  Topology topo;
  JAXOVERLAP_RETURN_IF_ERROR(MakeTopology(groups.begin(), groups.size(), group_size, s.my_pe,
                                          s.num_pes, s.ranks_per_node, &topo));
  return AllReduce(stream, static_cast<Algorithm>(algorithm), static_cast<Protocol>(protocol),
                   x.element_type(), x.untyped_data(), out->untyped_data(), x.element_count(),
                   topo);
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
        .Attr<int64_t>("algorithm")   // Algorithm enum value (all_reduce.h)
        .Attr<int64_t>("protocol"),   // Protocol enum value (all_reduce.h)
    {xla::ffi::Traits::kCmdBufferCompatible});
