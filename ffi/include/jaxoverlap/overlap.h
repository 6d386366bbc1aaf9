// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The fused compute-communication ops (CommFuse): AllGather+GEMM,
// GEMM+ReduceScatter and GEMM+AllReduce over one node's group of PEs.
#ifndef JAXOVERLAP_OVERLAP_H_
#define JAXOVERLAP_OVERLAP_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jaxoverlap/gemm.h"
#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::overlap {

namespace ffi = xla::ffi;

// How shards move. The extension exports the enum to Python under the names
// of jaxoverlap/names.py (module.cc); the FFI decodes it as an enum attribute.
enum class Transport : int32_t {
  kCopyEngine = 0,  // cudaMemcpyAsync to the peer's mapped slot, then a signal kernel
  kNvshmem = 1,     // a kernel of NVSHMEM block puts, the last block signals
};

// The group of one call as seen by this PE: all members on this PE's node.
struct Group {
  int rank = 0;                     // this PE's position in the group
  int size = 0;
  int pes[kMaxGroupSize] = {};      // PEs in rank order
  int local[kMaxGroupSize] = {};    // their local ranks on the node (slot/flag index)
};

// Builds the group holding the PE of runtime `s` from the flat `groups`
// attribute. Errors: malformed groups, this PE in none, a member on another node.
ffi::Error MakeGroup(const RuntimeState& s, const char* op, ffi::Span<const int64_t> groups,
                     int64_t group_size, Group* group);

// The attributes of every fused custom call (decoded as one struct; computed
// by jaxoverlap/_cuda.py from the plan and the shapes). For
// matmul_all_reduce, outer is 1.
struct Attrs {
  ffi::Span<const int64_t> groups;  // [num_groups * group_size] PEs, each group in rank order
  int64_t group_size;
  Transport transport;
  int64_t chunks;                   // chunks per shard transfer, 1..kMaxChunks
  gemm::Precision precision;
  int64_t outer, rows, k, n;        // the op's shape (overlap.h's functions below)
};

struct Options {
  Transport transport = Transport::kCopyEngine;
  int chunks = 1;  // chunks per shard transfer, 1..kMaxChunks
  gemm::Precision precision = gemm::Precision::kDefault;
};

// out[o, g*rows + i, :] = x_g[o, i, :] @ w for every group rank g, where x_g
// is rank g's x: [outer, rows, k]; w: [k, n]; out: [outer, size*rows, n].
// When `gathered` is not null it receives the x_g: [outer, size*rows, k].
// Each runs on the GPU whose runtime is `s`.
ffi::Error AllGatherMatmul(const RuntimeState& s, cudaStream_t stream, const Group& group,
                           const Options& opt, ffi::DataType dtype, const void* x, const void* w,
                           void* out, void* gathered, int64_t outer, int64_t rows, int64_t k,
                           int64_t n);

// out[o, i, :] = sum_g (x_g[o, rank*rows + i, :] @ w_g): x: [outer, size*rows, k],
// w: [k, n], out: [outer, rows, n].
ffi::Error MatmulReduceScatter(const RuntimeState& s, cudaStream_t stream, const Group& group,
                               const Options& opt, ffi::DataType dtype, const void* x,
                               const void* w, void* out, int64_t outer, int64_t rows, int64_t k,
                               int64_t n);

// out = sum_g x_g @ w_g, the same on every rank: x: [size*rows, k], w: [k, n],
// out: [size*rows, n].
ffi::Error MatmulAllReduce(const RuntimeState& s, cudaStream_t stream, const Group& group,
                           const Options& opt, ffi::DataType dtype, const void* x, const void* w,
                           void* out, int64_t rows, int64_t k, int64_t n);

// Loads this file's kernels on the current GPU (at start-up). CUDA loads
// kernels lazily, and loading one may wait for every kernel running on the
// GPU, including one that waits for a peer (gemm::Preload).
ffi::Error PreloadKernels();

}  // namespace jaxoverlap::overlap

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jaxoverlap::overlap::Transport);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jaxoverlap::gemm::Precision);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxoverlap::overlap::Attrs,
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<int64_t>("group_size"),
    ::xla::ffi::StructMember<jaxoverlap::overlap::Transport>("transport"),
    ::xla::ffi::StructMember<int64_t>("chunks"),
    ::xla::ffi::StructMember<jaxoverlap::gemm::Precision>("precision"),
    ::xla::ffi::StructMember<int64_t>("outer"),
    ::xla::ffi::StructMember<int64_t>("rows"),
    ::xla::ffi::StructMember<int64_t>("k"),
    ::xla::ffi::StructMember<int64_t>("n"));

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGathered);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduce);
// The same handlers with the command-buffer trait (overlap_ffi.cc says why both).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulCmdBuffer);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllGatherMatmulGatheredCmdBuffer);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapMatmulReduceScatterCmdBuffer);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapMatmulAllReduceCmdBuffer);

#endif  // JAXOVERLAP_OVERLAP_H_
