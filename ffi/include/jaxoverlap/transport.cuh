// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The transport interface of the kernels: where a peer's copy of a symmetric
// address lives, and how a flag is raised on a peer.
//
// Two runtimes provide the symmetric memory (runtime.h):
//  * NVSHMEM, one PE per process: the heap is nvshmem_malloc'ed and
//    nvshmem_ptr() gives a load/store pointer to a peer's copy where NVLink or
//    PCIe peer access reaches it (null otherwise: then the kernels put).
//  * In-process ("peer"): one process drives every GPU of its node; each GPU
//    has a heap of the same layout, allocated with cudaMalloc, and peer access
//    is enabled between all of them. A PE is one of these GPUs; a peer's copy
//    is the same offset in that GPU's heap.
// Kernels ask PeerAddress() and SignalSet(); nothing else in them depends on
// the runtime.
#ifndef JAXOVERLAP_TRANSPORT_CUH_
#define JAXOVERLAP_TRANSPORT_CUH_

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "jaxoverlap/runtime.h"

namespace jaxoverlap {

// A load/store pointer to PE `pe`'s copy of the symmetric `sym`, or null when
// `pe` is not load/store-reachable from this GPU.
template <typename P>
__host__ __device__ __forceinline__ P* PeerAddress(const PeerMap& m, P* sym, int pe) {
  if (m.in_process) {
    const int local = pe - m.first_pe;
    if (local < 0 || local >= m.num_local || m.heaps[local] == nullptr) return nullptr;
    const auto offset = reinterpret_cast<const char*>(sym) - m.self;
    return reinterpret_cast<P*>(m.heaps[local] + offset);
  }
  return static_cast<P*>(nvshmem_ptr(const_cast<void*>(static_cast<const void*>(sym)), pe));
}

// Sets the symmetric flag `flag` on PE `pe` to `value`, after this thread's
// earlier writes are visible system-wide (release), on either transport.
__device__ __forceinline__ void SignalSet(const PeerMap& m, uint64_t* flag, uint64_t value,
                                          int pe) {
  // The fence is the release for both branches: NVSHMEM's SIGNAL_SET to a PE it reaches over
  // NVLink is a plain volatile store (NVSHMEM 3.4, nvshmemi_signal_op), with no fence of its own.
  __threadfence_system();
  if (m.in_process) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(PeerAddress(m, flag, pe)),
                 "l"(value)
                 : "memory");
    return;
  }
  nvshmemx_signal_op(flag, value, NVSHMEM_SIGNAL_SET, pe);
}

}  // namespace jaxoverlap

#endif  // JAXOVERLAP_TRANSPORT_CUH_
