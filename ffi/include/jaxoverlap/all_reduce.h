// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
#ifndef JAXOVERLAP_ALL_REDUCE_H_
#define JAXOVERLAP_ALL_REDUCE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::all_reduce {

namespace ffi = xla::ffi;

// Algorithms and protocols. The extension exports both enums to Python under
// the names of jaxoverlap/names.py (module.cc), and the FFI decodes them as enum
// attributes; jaxoverlap.dispatch always chooses a protocol (there is no "auto"
// here).
enum class Algorithm : int32_t { kOneShot = 1, kTwoShot = 2, kHierarchical = 3 };
enum class Protocol : int32_t { kLL = 1, kSimple = 2, kLamport = 3 };
// What one call runs: the whole all-reduce, or one of the two intra-node steps
// of the hierarchical all-reduce whose inter-node step is XLA's collective
// (the in-process runtime across processes, jaxoverlap/_cuda.py).
enum class Stage : int32_t { kAll = 0, kReduceScatter = 1, kAllGather = 2 };

// The attributes of one all_reduce custom call (decoded as one struct).
struct Attrs {
  ffi::Span<const int64_t> groups;  // [num_groups * group_size] PEs, each group in rank order
  int64_t group_size;               // ranks per group (the shard_map axis size)
  Algorithm algorithm;
  Protocol protocol;
};

// One all-reduce group as seen by one member, split by node: `local_pes` are
// the group's PEs on this PE's node (in rank order), `node_pes[k]` the PE with
// this PE's local rank on the group's k-th node.
struct Topology {
  int rank = 0;                       // position in the whole group
  int num_ranks = 0;                  // group size = num_nodes * local_size
  int local_rank = 0;
  int local_size = 0;
  int local_pes[kMaxGroupSize] = {};
  int node = 0;
  int num_nodes = 0;
  int node_pes[kMaxNodes] = {};
};

// Builds the topology of the group holding `my_pe` from the flat `groups`
// list (each group in rank order, each PE once) and `ranks_per_node` (node =
// pe / rpn); errors name `op`.
ffi::Error MakeTopology(const char* op, const int64_t* groups, size_t num_entries,
                        int64_t group_size, int my_pe, int num_pes, int ranks_per_node,
                        Topology* topo);

// kFailedPrecondition naming the pair when a PE of this PE's node in `t`
// cannot be reached by load/store (the kernels store through PeerAddress; a
// null address would be an illegal access on the device).
ffi::Error CheckLocalPeers(const RuntimeState& s, const Topology& t, const char* op);

// The PEs of this PE's node (node = pe / s.ranks_per_node) whose heap it cannot
// reach by load/store (no NVLink or PCIe peer access), in PE order; empty
// before start-up. initialize() gathers them from every process, so that
// plans can leave such groups to XLA before any kernel runs.
std::vector<int> UnreachableLocalPes(const RuntimeState& s);

// All-reduce of `num_elements` elements of `dtype` from `in` to `out` over the
// group, on `stream`, by the GPU whose runtime is `s`. Messages larger than
// one launch's capacity go through in chunks; every launch depends only on the
// arguments (command-buffer safe).
ffi::Error AllReduce(const RuntimeState& s, cudaStream_t stream, Algorithm algorithm,
                     Protocol protocol, ffi::DataType dtype, const void* in, void* out,
                     size_t num_elements, const Topology& topo);

// One intra-node step of the all-reduce over `topo`'s local ranks, in one
// launch (two-shot layout, simple protocol): kReduceScatter reads
// `num_elements` elements of `dtype` from `in` and writes this rank's reduced
// shard, fp32 [shard_elements], zero-padded, to `out`; kAllGather reads that
// shard from `in` and writes all `num_elements` elements to `out`.
// `shard_elements` must be the two-shot shard of `num_elements` (16-byte
// multiple of ceil(num_elements / local_size)) and fit one slot.
ffi::Error AllReduceStage(const RuntimeState& s, cudaStream_t stream, Stage stage,
                          ffi::DataType dtype, const void* in, void* out, size_t num_elements,
                          size_t shard_elements, const Topology& topo);

// The fused all-reduce + residual add + RMSNorm over `topo` (one node), in one
// launch of the one-shot LL all-reduce: h = residual + sum over the group of
// p, rounded to `dtype`; y = h * rsqrt(mean(h^2) + eps) * weight, in fp32 from
// the rounded h, rounded to `dtype`. p, residual, h, y: [rows, hidden];
// weight: [hidden]. A row must be a whole number of 8-byte lines and the
// message must fit one LL slot (rows * hidden * elem * 2 <= ll_slot_bytes).
ffi::Error AllReduceRmsNorm(const RuntimeState& s, cudaStream_t stream, ffi::DataType dtype,
                            const void* p, const void* residual, const void* weight, void* h,
                            void* y, size_t rows, size_t hidden, float eps,
                            const Topology& topo);

// Loads this file's kernels on the current GPU (at start-up; see
// overlap::PreloadKernels).
ffi::Error PreloadKernels();

// Blocks of the Lamport kernels that one SM of the current GPU holds at once
// (the CUDA occupancy calculator; the fewest over their instantiations).
ffi::Error LamportBlocksPerSm(int* blocks);

// Clusters of c blocks of all_reduce_rms_norm's kernel, at its largest block,
// that the current GPU holds at once, into clusters[c] for c = 1 ..
// kMaxNormCluster (the CUDA occupancy calculator; the fewest over the dtypes).
// clusters[1] counts plain blocks; on a GPU without cluster launch (before
// Hopper) clusters[2 ..] are 0.
ffi::Error NormClustersAtOnce(int* clusters);

// The measurement knobs in effect in this process (each read once per process;
// docs/design.md lists them), for runtime_info():
// The kernel that algorithm hierarchical with protocol ll runs: "v4"
// (HierarchicalLLKernel), or "v3" under JAXOVERLAP_HIERARCHICAL_LL=v3.
const char* HierarchicalLLKernelName();
// Whether the one-shot LL kernels advance the epochs at their start
// (JAXOVERLAP_EPOCH_AT_START=1) rather than at their end.
bool EpochsAtStart();
// all_reduce_rms_norm's blocks a row as JAXOVERLAP_NORM_CLUSTER sets them, or
// 0 (unset: from the row's size).
int NormBlocksPerRowKnob();

}  // namespace jaxoverlap::all_reduce

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jaxoverlap::all_reduce::Algorithm);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jaxoverlap::all_reduce::Protocol);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxoverlap::all_reduce::Attrs,
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<int64_t>("group_size"),
    ::xla::ffi::StructMember<jaxoverlap::all_reduce::Algorithm>("algorithm"),
    ::xla::ffi::StructMember<jaxoverlap::all_reduce::Protocol>("protocol"));

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduceReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduceAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduceRmsNorm);

#endif  // JAXOVERLAP_ALL_REDUCE_H_
