// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
#ifndef JAXOVERLAP_ALL_REDUCE_H_
#define JAXOVERLAP_ALL_REDUCE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::all_reduce {

namespace ffi = xla::ffi;

// Algorithm and protocol ids; jaxoverlap/_cuda.py uses the same numbers.
enum class Algorithm : int { kOneShot = 1, kTwoShot = 2, kHierarchical = 3 };
enum class Protocol : int { kAuto = 0, kLL = 1, kSimple = 2 };

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
// list (each group in rank order) and `ranks_per_node` (node = pe / rpn).
ffi::Error MakeTopology(const int64_t* groups, size_t num_entries, int64_t group_size, int my_pe,
                        int num_pes, int ranks_per_node, Topology* topo);

// All-reduce of `num_elements` elements of `dtype` from `in` to `out` over the
// group, on `stream`. Messages larger than one launch's capacity go through in
// chunks; every launch depends only on the arguments (command-buffer safe).
ffi::Error AllReduce(cudaStream_t stream, Algorithm algorithm, Protocol protocol,
                     ffi::DataType dtype, const void* in, void* out, size_t num_elements,
                     const Topology& topo);

}  // namespace jaxoverlap::all_reduce

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduce);

#endif  // JAXOVERLAP_ALL_REDUCE_H_
