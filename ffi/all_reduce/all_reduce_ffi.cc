// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI binding of the all-reduce kernels: validates the call, finds this
// PE's group in the `groups` attribute (computed at lowering time from the
// shard_map mesh) and launches the planned algorithm on XLA's stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/check.h"
#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::all_reduce {

namespace ffi = xla::ffi;

namespace {

// The kernels move `alignment`-byte vectors of XLA's buffers (16 bytes; the
// norm kernel 8). XLA aligns its buffers to more than that, but a buffer that
// is not would fault on the GPU and lose the context: refused here, by name.
ffi::Error CheckAligned(const char* op,
                        std::initializer_list<std::pair<const char*, const void*>> buffers,
                        uintptr_t alignment) {
  for (const auto& [name, data] : buffers) {
    if (reinterpret_cast<uintptr_t>(data) % alignment != 0) {
      return ffi::Error::InvalidArgument(std::string(op) + ": buffer " + name + " is not " +
                                         std::to_string(alignment) + "-byte aligned");
    }
  }
  return ffi::Error::Success();
}

ffi::Error AllReduceExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution("all_reduce", stream, device));
  const RuntimeState& s = State(device);
  if (x.element_type() != out->element_type() || x.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("all_reduce: output type/shape differs from the input");
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckAligned(
      "all_reduce", {{"x", x.untyped_data()}, {"out", out->untyped_data()}}, 16));
  Topology topo;
  JAXOVERLAP_RETURN_IF_ERROR(MakeTopology("all_reduce", attrs.groups.begin(),
                                          attrs.groups.size(), attrs.group_size, s.my_pe,
                                          s.num_pes, s.ranks_per_node, &topo));
  JAXOVERLAP_RETURN_IF_ERROR(CheckLocalPeers(s, topo, "all_reduce"));
  return AllReduce(s, stream, attrs.algorithm, attrs.protocol, x.element_type(),
                   x.untyped_data(), out->untyped_data(), x.element_count(), topo);
}

// One intra-node step of the hierarchical all-reduce whose inter-node step is
// XLA's collective (all_reduce.h, AllReduceStage).
template <Stage kStage>
ffi::Error StageExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                        int64_t group_size) {
  constexpr bool kRS = kStage == Stage::kReduceScatter;
  const char* op = kRS ? "all_reduce (intra-node reduce-scatter)"
                       : "all_reduce (intra-node all-gather)";
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution(op, stream, device));
  const RuntimeState& s = State(device);
  const ffi::AnyBuffer& shard = kRS ? *out : x;
  const ffi::AnyBuffer& full = kRS ? x : *out;
  if (shard.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the shard must be float32");
  }
  JAXOVERLAP_RETURN_IF_ERROR(
      CheckAligned(op, {{"x", x.untyped_data()}, {"out", out->untyped_data()}}, 16));
  Topology topo;
  JAXOVERLAP_RETURN_IF_ERROR(MakeTopology(op, groups.begin(), groups.size(), group_size,
                                          s.my_pe, s.num_pes, s.ranks_per_node, &topo));
  JAXOVERLAP_RETURN_IF_ERROR(CheckLocalPeers(s, topo, op));
  return AllReduceStage(s, stream, kStage, full.element_type(), x.untyped_data(),
                        out->untyped_data(), full.element_count(), shard.element_count(), topo);
}

// h = residual + all_reduce(p), y = rms_norm(h) * weight (all_reduce.h, AllReduceRmsNorm).
ffi::Error AllReduceRmsNormExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer p,
                                   ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                                   ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> y,
                                   ffi::Span<const int64_t> groups, int64_t group_size,
                                   float eps) {
  constexpr const char* kOp = "all_reduce_rms_norm";
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution(kOp, stream, device));
  const RuntimeState& s = State(device);
  const ffi::DataType dtype = p.element_type();
  if (residual.element_type() != dtype || weight.element_type() != dtype ||
      h->element_type() != dtype || y->element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": p, residual, weight, h and y must share one dtype");
  }
  const auto dims = p.dimensions();
  if (dims.size() < 1) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": p must be [..., hidden]");
  }
  const size_t hidden = static_cast<size_t>(dims.back());
  const size_t count = p.element_count();
  if (residual.element_count() != count || h->element_count() != count ||
      y->element_count() != count || weight.element_count() != hidden) {
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": residual, h and y must have p's " + std::to_string(count) +
        " elements and weight the " + std::to_string(hidden) + " of its last dimension");
  }
  JAXOVERLAP_RETURN_IF_ERROR(CheckAligned(
      kOp,
      {{"p", p.untyped_data()}, {"residual", residual.untyped_data()},
       {"weight", weight.untyped_data()}, {"h", h->untyped_data()}, {"y", y->untyped_data()}},
      8));
  Topology topo;
  JAXOVERLAP_RETURN_IF_ERROR(MakeTopology(kOp, groups.begin(), groups.size(), group_size,
                                          s.my_pe, s.num_pes, s.ranks_per_node, &topo));
  JAXOVERLAP_RETURN_IF_ERROR(CheckLocalPeers(s, topo, kOp));
  return AllReduceRmsNorm(s, stream, dtype, p.untyped_data(), residual.untyped_data(),
                          weight.untyped_data(), h->untyped_data(), y->untyped_data(),
                          hidden == 0 ? 0 : count / hidden, hidden, eps, topo);
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

#define JAXOVERLAP_STAGE_BINDING                                                       \
  xla::ffi::Ffi::Bind()                                                                \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                   \
      .Ctx<xla::ffi::DeviceOrdinal>()                                                  \
      .Arg<xla::ffi::AnyBuffer>()                                                      \
      .Ret<xla::ffi::AnyBuffer>()                                                      \
      .Attr<xla::ffi::Span<const int64_t>>("groups")                                   \
      .Attr<int64_t>("group_size")

// x: [n] f32/bf16/f16 (the message, flattened) -> out: f32 [shard] this rank's reduced shard.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapAllReduceReduceScatter,
    jaxoverlap::all_reduce::StageExecute<jaxoverlap::all_reduce::Stage::kReduceScatter>,
    JAXOVERLAP_STAGE_BINDING, {xla::ffi::Traits::kCmdBufferCompatible});

// x: f32 [shard] this rank's shard, reduced across nodes -> out: [n] f32/bf16/f16.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapAllReduceAllGather,
    jaxoverlap::all_reduce::StageExecute<jaxoverlap::all_reduce::Stage::kAllGather>,
    JAXOVERLAP_STAGE_BINDING, {xla::ffi::Traits::kCmdBufferCompatible});

#undef JAXOVERLAP_STAGE_BINDING

// p, residual: [..., hidden], weight: [hidden] (one dtype) -> h, y: [..., hidden].
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxoverlapAllReduceRmsNorm, jaxoverlap::all_reduce::AllReduceRmsNormExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Ctx<xla::ffi::DeviceOrdinal>()
        .Arg<xla::ffi::AnyBuffer>()  // p: this rank's partial sums
        .Arg<xla::ffi::AnyBuffer>()  // residual
        .Arg<xla::ffi::AnyBuffer>()  // weight
        .Ret<xla::ffi::AnyBuffer>()  // h = residual + all_reduce(p)
        .Ret<xla::ffi::AnyBuffer>()  // y = rms_norm(h) * weight
        .Attr<xla::ffi::Span<const int64_t>>("groups")
        .Attr<int64_t>("group_size")
        .Attr<float>("eps"),
    {xla::ffi::Traits::kCmdBufferCompatible});
