// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
#ifndef JAXOVERLAP_ALL_REDUCE_H_
#define JAXOVERLAP_ALL_REDUCE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::all_reduce {

namespace ffi = xla::ffi;

// The ranks of one all-reduce group, as seen by one member.
struct Group {
  int rank = 0;                 // this PE's position in the group
  int num_ranks = 0;            // group size
  int pes[kMaxGroupSize] = {};  // PE of each rank, in rank order
};

enum class Algorithm : int { kOneShot = 1 };

// One-shot all-reduce of `num_elements` elements of `dtype` from `in` into
// `out` over `group`, on `stream`. Launches exactly the same device work for
// the same arguments (command-buffer safe).
ffi::Error OneShot(cudaStream_t stream, ffi::DataType dtype, const void* in, void* out,
                   size_t num_elements, const Group& group);

}  // namespace jaxoverlap::all_reduce

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAllReduce);

#endif  // JAXOVERLAP_ALL_REDUCE_H_
