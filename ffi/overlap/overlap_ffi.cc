// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI bindings of the fused ops: validate the call against the shape
// attributes computed at lowering time (jaxoverlap/_cuda.py), find this PE's
// group and run the op on XLA's stream.
#include <cuda_runtime_api.h>

#include <cstdint>
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
ffi::Error Prepare(const char* op, cudaStream_t stream, ffi::Span<const int64_t> groups,
                   int64_t group_size, int64_t transport, int64_t chunks, int64_t precision,
                   Group* group, Options* opt) {
  JAXOVERLAP_RETURN_IF_ERROR(CheckExecution(op, stream));
  if (transport < 0 || transport > 1 || chunks < 1 || chunks > kMaxChunks || precision < 0 ||
      precision > 1) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": bad attributes transport=" + std::to_string(transport) +
        " chunks=" + std::to_string(chunks) + " (1.." + std::to_string(kMaxChunks) +
        ") precision=" + std::to_string(precision));
  }
  JAXOVERLAP_RETURN_IF_ERROR(MakeGroup(op, groups, group_size, group));
  opt->transport = static_cast<Transport>(transport);
  opt->chunks = static_cast<int>(chunks);
  opt->precision = static_cast<gemm::Precision>(precision);
  return ffi::Error::Success();
}

ffi::Error CheckBuffer(const char* op, const char* name, const ffi::AnyBuffer& b,
                       ffi::DataType dtype, int64_t expected) {
  if (b.element_type() != dtype || static_cast<int64_t>(b.element_count()) != expected) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": buffer " + name + " has " + std::to_string(b.element_count()) +
        " elements of type " + std::to_string(static_cast<int>(b.element_type())) + ", expected " +
        std::to_string(expected) + " of type " + std::to_string(static_cast<int>(dtype)));
  }
  return ffi::Error::Success();
}

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::AnyBuffer* out, ffi::AnyBuffer* gathered,
                               ffi::Span<const int64_t> groups, int64_t group_size,
                               int64_t transport, int64_t chunks, int64_t precision,
                               int64_t outer, int64_t rows, int64_t k, int64_t n) {
  const char* op = "all_gather_matmul";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(
      Prepare(op, stream, groups, group_size, transport, chunks, precision, &g, &opt));
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, outer * rows * k));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, k * n));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, outer * g.size * rows * n));
  if (gathered != nullptr) {
    JAXOVERLAP_RETURN_IF_ERROR(
        CheckBuffer(op, "gathered", *gathered, t, outer * g.size * rows * k));
  }
  return AllGatherMatmul(stream, g, opt, t, x.untyped_data(), w.untyped_data(),
                         out->untyped_data(),
                         gathered != nullptr ? gathered->untyped_data() : nullptr, outer, rows, k,
                         n);
}

ffi::Error AllGatherMatmulExecute(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Span<const int64_t> groups, int64_t group_size,
                                  int64_t transport, int64_t chunks, int64_t precision,
                                  int64_t outer, int64_t rows, int64_t k, int64_t n) {
  return AllGatherMatmulImpl(stream, x, w, &*out, nullptr, groups, group_size, transport, chunks,
                             precision, outer, rows, k, n);
}

ffi::Error AllGatherMatmulGatheredExecute(cudaStream_t stream, ffi::AnyBuffer x,
                                          ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                          ffi::Result<ffi::AnyBuffer> gathered,
                                          ffi::Span<const int64_t> groups, int64_t group_size,
                                          int64_t transport, int64_t chunks, int64_t precision,
                                          int64_t outer, int64_t rows, int64_t k, int64_t n) {
  return AllGatherMatmulImpl(stream, x, w, &*out, &*gathered, groups, group_size, transport,
                             chunks, precision, outer, rows, k, n);
}

ffi::Error MatmulReduceScatterExecute(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                      ffi::Result<ffi::AnyBuffer> out,
                                      ffi::Span<const int64_t> groups, int64_t group_size,
                                      int64_t transport, int64_t chunks, int64_t precision,
                                      int64_t outer, int64_t rows, int64_t k, int64_t n) {
  const char* op = "matmul_reduce_scatter";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(
      Prepare(op, stream, groups, group_size, transport, chunks, precision, &g, &opt));
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, outer * g.size * rows * k));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, k * n));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, outer * rows * n));
  return MatmulReduceScatter(stream, g, opt, t, x.untyped_data(), w.untyped_data(),
                             out->untyped_data(), outer, rows, k, n);
}

ffi::Error MatmulAllReduceExecute(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Span<const int64_t> groups, int64_t group_size,
                                  int64_t transport, int64_t chunks, int64_t precision,
                                  int64_t rows, int64_t k, int64_t n) {
  const char* op = "matmul_all_reduce";
  Group g;
  Options opt;
  JAXOVERLAP_RETURN_IF_ERROR(
      Prepare(op, stream, groups, group_size, transport, chunks, precision, &g, &opt));
  const ffi::DataType t = x.element_type();
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "x", x, t, g.size * rows * k));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "w", w, t, k * n));
  JAXOVERLAP_RETURN_IF_ERROR(CheckBuffer(op, "out", *out, t, g.size * rows * n));
  return MatmulAllReduce(stream, g, opt, t, x.untyped_data(), w.untyped_data(),
                         out->untyped_data(), rows, k, n);
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
// buffer (gemm.cc, AlignmentCap). So captured, the checks of
// tests/multiprocess/check_overlap.py ("graphs", "rotation", all sections) and
// 200-step training runs pass, but a training step under jax.profiler tracing
// still failed to update (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE; NOTES.md "CUDA
// graphs"), hence opt-in. The ops last milliseconds, so a graph launch saves
// little.
//
// Attributes shared by the fused ops (computed by jaxoverlap/_cuda.py):
//   groups [num_groups * group_size] PEs, each group in rank order;
//   transport (Transport enum), chunks (1..kMaxChunks), precision (gemm::Precision).
#define JAXOVERLAP_FUSED_ATTRS                                  \
  .Attr<xla::ffi::Span<const int64_t>>("groups")                \
      .Attr<int64_t>("group_size")                              \
      .Attr<int64_t>("transport")                               \
      .Attr<int64_t>("chunks")                                  \
      .Attr<int64_t>("precision")

// x: [outer, rows, k] this rank's shard; w: [k, n]; out: [outer, size * rows, n].
#define JAXOVERLAP_AG_BINDING                                   \
  xla::ffi::Ffi::Bind()                                         \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()            \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Ret<xla::ffi::AnyBuffer>() JAXOVERLAP_FUSED_ATTRS        \
      .Attr<int64_t>("outer")                                   \
      .Attr<int64_t>("rows")                                    \
      .Attr<int64_t>("k")                                       \
      .Attr<int64_t>("n")

// As above, plus the gathered x: [outer, size * rows, k].
#define JAXOVERLAP_AG_GATHERED_BINDING                          \
  xla::ffi::Ffi::Bind()                                         \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()            \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Ret<xla::ffi::AnyBuffer>()                               \
      .Ret<xla::ffi::AnyBuffer>() JAXOVERLAP_FUSED_ATTRS        \
      .Attr<int64_t>("outer")                                   \
      .Attr<int64_t>("rows")                                    \
      .Attr<int64_t>("k")                                       \
      .Attr<int64_t>("n")

// x: [outer, size * rows, k]; w: [k, n]; out: [outer, rows, n], this rank's block.
#define JAXOVERLAP_RS_BINDING JAXOVERLAP_AG_BINDING

// x: [size * rows, k]; w: [k, n]; out: [size * rows, n].
#define JAXOVERLAP_AR_BINDING                                   \
  xla::ffi::Ffi::Bind()                                         \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()            \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Arg<xla::ffi::AnyBuffer>()                               \
      .Ret<xla::ffi::AnyBuffer>() JAXOVERLAP_FUSED_ATTRS        \
      .Attr<int64_t>("rows")                                    \
      .Attr<int64_t>("k")                                       \
      .Attr<int64_t>("n")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmul,
                              jaxoverlap::overlap::AllGatherMatmulExecute, JAXOVERLAP_AG_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGathered,
                              jaxoverlap::overlap::AllGatherMatmulGatheredExecute,
                              JAXOVERLAP_AG_GATHERED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatter,
                              jaxoverlap::overlap::MatmulReduceScatterExecute,
                              JAXOVERLAP_RS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduce,
                              jaxoverlap::overlap::MatmulAllReduceExecute, JAXOVERLAP_AR_BINDING);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulCmdBuffer,
                              jaxoverlap::overlap::AllGatherMatmulExecute, JAXOVERLAP_AG_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGatheredCmdBuffer,
                              jaxoverlap::overlap::AllGatherMatmulGatheredExecute,
                              JAXOVERLAP_AG_GATHERED_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatterCmdBuffer,
                              jaxoverlap::overlap::MatmulReduceScatterExecute,
                              JAXOVERLAP_RS_BINDING, {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduceCmdBuffer,
                              jaxoverlap::overlap::MatmulAllReduceExecute, JAXOVERLAP_AR_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
