// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI bindings of the fused ops: validate the call against the shape
// attributes computed at lowering time (jaxoverlap/_cuda.py), find this PE's
// group and run the op on XLA's stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "jaxoverlap/check.h"
#include "jaxoverlap/gemm.h"
#include "jaxoverlap/overlap.h"
#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::overlap {

namespace ffi = xla::ffi;

namespace {

// The checks every fused call makes before it enqueues anything.
ffi::Error Prepare(const char* op, cudaStream_t stream, int32_t device, const Attrs& attrs,
                   Group* group, Options* opt) {
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution(op, stream, device));
  const bool transport_ok =
      attrs.transport == Transport::kCopyEngine || attrs.transport == Transport::kNvshmem;
  const bool precision_ok = attrs.precision == gemm::Precision::kDefault ||
                            attrs.precision == gemm::Precision::kHighest;
  if (!transport_ok || !precision_ok || attrs.chunks < 1 || attrs.chunks > kMaxChunks) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": bad attributes transport=" +
        std::to_string(static_cast<int>(attrs.transport)) + " chunks=" +
        std::to_string(attrs.chunks) + " (1.." + std::to_string(kMaxChunks) + ") precision=" +
        std::to_string(static_cast<int>(attrs.precision)));
  }
  // Python plans empty operands on XLA; an empty dimension here would still
  // run the row chunks' GEMMs (batch 1) past the empty buffers. The batch is
  // cuBLASLt's int32 batch count.
  if (attrs.outer < 1 || attrs.rows < 1 || attrs.k < 1 || attrs.n < 1 ||
      attrs.outer > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": every dimension must be at least 1 (outer at most 2^31 - 1), got "
        "outer=" + std::to_string(attrs.outer) + " rows=" + std::to_string(attrs.rows) +
        " k=" + std::to_string(attrs.k) + " n=" + std::to_string(attrs.n));
  }
  JAXOVERLAP_RETURN_IF_ERROR(MakeGroup(State(device), op, attrs.groups, attrs.group_size, group));
  opt->transport = attrs.transport;
  opt->chunks = static_cast<int>(attrs.chunks);
  opt->precision = attrs.precision;
  return ffi::Error::Success();
}

// `b` holds the product of `factors` elements of `dtype`; a product past
// int64 (attributes no buffer can match) is refused as such.
ffi::Error CheckBuffer(const char* op, const char* name, const ffi::AnyBuffer& b,
                       ffi::DataType dtype, std::initializer_list<int64_t> factors) {
  int64_t expected = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(expected, f, &expected)) {
      return ffi::Error::InvalidArgument(std::string(op) + ": the element count of buffer " +
                                         name + " overflows int64; bad shape attributes");
    }
  }
  if (b.element_type() != dtype || static_cast<int64_t>(b.element_count()) != expected) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": buffer " + name + " has " + std::to_string(b.element_count()) +
        " elements of type " + std::to_string(static_cast<int>(b.element_type())) + ", expected " +
        std::to_string(expected) + " of type " + std::to_string(static_cast<int>(dtype)));
  }
  return ffi::Error::Success();
}

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer w, ffi::AnyBuffer* out, ffi::AnyBuffer* gathered,
                               const Attrs& a) {
  const char* op = "all_gather_matmul";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(Prepare(op, stream, device, a, &g, &opt));
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, {a.outer, a.rows, a.k}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, {a.k, a.n}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, {a.outer, g.size, a.rows, a.n}));
  if (gathered != nullptr) {
    JAXOVERLAP_RETURN_IF_ERROR(
        CheckBuffer(op, "gathered", *gathered, t, {a.outer, g.size, a.rows, a.k}));
  }
  return AllGatherMatmul(State(device), stream, g, opt, t, x.untyped_data(), w.untyped_data(),
                         out->untyped_data(),
                         gathered != nullptr ? gathered->untyped_data() : nullptr, a.outer, a.rows,
                         a.k, a.n);
}

ffi::Error AllGatherMatmulExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                  Attrs attrs) {
  return AllGatherMatmulImpl(stream, device, x, w, &*out, nullptr, attrs);
}

ffi::Error AllGatherMatmulGatheredExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                          ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                          ffi::Result<ffi::AnyBuffer> gathered, Attrs attrs) {
  return AllGatherMatmulImpl(stream, device, x, w, &*out, &*gathered, attrs);
}

ffi::Error MatmulReduceScatterExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                      ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                      Attrs a) {
  const char* op = "matmul_reduce_scatter";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(Prepare(op, stream, device, a, &g, &opt));
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, {a.outer, g.size, a.rows, a.k}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, {a.k, a.n}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, {a.outer, a.rows, a.n}));
  return MatmulReduceScatter(State(device), stream, g, opt, t, x.untyped_data(),
                             w.untyped_data(),
                             out->untyped_data(), a.outer, a.rows, a.k, a.n);
}

ffi::Error MatmulAllReduceExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, Attrs a) {
  const char* op = "matmul_all_reduce";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(Prepare(op, stream, device, a, &g, &opt));
  if (a.outer != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": outer must be 1, got " +
                                       std::to_string(a.outer));
  }
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, {g.size, a.rows, a.k}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, {a.k, a.n}));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, {g.size, a.rows, a.n}));
  return MatmulAllReduce(State(device), stream, g, opt, t, x.untyped_data(),
                         w.untyped_data(),
                         out->untyped_data(), a.rows, a.k, a.n);
}

}  // namespace

}  // namespace jaxoverlap::overlap

// The fused handlers are registered twice. The plain targets carry no
// xla::ffi::Traits::kCmdBufferCompatible, so XLA runs them as thunks of their
// own between its CUDA graphs; jaxoverlap uses these by default. The "_cmdbuf"
// targets carry the trait, and the lowering uses them with
// JAXOVERLAP_FUSED_CMD_BUFFER=1: XLA then records each call into its graphs
// and, when buffers move, re-records it and updates the graph in place. For
// that, no call enqueues a 2-D memcpy on an XLA buffer (CUDA cannot update one;
// overlap.cu, CopyRows) and cuBLASLt plans do not depend on where XLA placed a
// buffer (gemm.cc, AlignmentCap). So captured, the GPU tests of
// tests/gpu/ranks/rank_overlap.py (test_graphs, test_rotation, all of them) and
// 200-step training runs pass, but a training step under jax.profiler tracing
// still failed to update (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE; docs/kernels.md
// "CUDA graphs"), hence opt-in. The ops last milliseconds, so a graph launch saves
// little.
//
// The bindings. Every fused call takes its attributes as one struct (overlap.h,
// Attrs: groups, group_size, transport, chunks, precision, outer, rows, k, n).
namespace {

// x: [outer, rows, k] this rank's shard; w: [k, n]; out: [outer, size * rows, n].
// Also matmul_reduce_scatter's: x: [outer, size * rows, k]; out: [outer, rows, n].
// And matmul_all_reduce's (outer 1): x: [size * rows, k]; out: [size * rows, n].
auto OneOutputBinding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Ctx<xla::ffi::DeviceOrdinal>()  // the GPU of this call (its runtime state)
      .Arg<xla::ffi::AnyBuffer>()   // x
      .Arg<xla::ffi::AnyBuffer>()   // w: [k, n]
      .Ret<xla::ffi::AnyBuffer>()   // out
      .Attrs<jaxoverlap::overlap::Attrs>();
}

// all_gather_matmul, plus the gathered x: [outer, size * rows, k].
auto GatheredBinding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Ctx<xla::ffi::DeviceOrdinal>()  // the GPU of this call (its runtime state)
      .Arg<xla::ffi::AnyBuffer>()   // x: [outer, rows, k]
      .Arg<xla::ffi::AnyBuffer>()   // w: [k, n]
      .Ret<xla::ffi::AnyBuffer>()   // out: [outer, size * rows, n]
      .Ret<xla::ffi::AnyBuffer>()   // gathered: [outer, size * rows, k]
      .Attrs<jaxoverlap::overlap::Attrs>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmul,
                              jaxoverlap::overlap::AllGatherMatmulExecute, OneOutputBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGathered,
                              jaxoverlap::overlap::AllGatherMatmulGatheredExecute,
                              GatheredBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatter,
                              jaxoverlap::overlap::MatmulReduceScatterExecute,
                              OneOutputBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduce,
                              jaxoverlap::overlap::MatmulAllReduceExecute, OneOutputBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulCmdBuffer,
                              jaxoverlap::overlap::AllGatherMatmulExecute, OneOutputBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGatheredCmdBuffer,
                              jaxoverlap::overlap::AllGatherMatmulGatheredExecute,
                              GatheredBinding(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatterCmdBuffer,
                              jaxoverlap::overlap::MatmulReduceScatterExecute, OneOutputBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduceCmdBuffer,
                              jaxoverlap::overlap::MatmulAllReduceExecute, OneOutputBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
