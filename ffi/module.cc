// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// The Python extension: FFI registrations and the runtime's host functions.
// Host functions raise RuntimeError with the ffi::Error's message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "jaxoverlap/all_reduce.h"
#include "jaxoverlap/gemm.h"
#include "jaxoverlap/overlap.h"
#include "jaxoverlap/runtime.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapLaunchFloor);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapLaunchFloorPdl);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapLaunchFloorBookkeeping);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapLaunchFloorPrefetch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapLaunchFloorShaped);

namespace nb = nanobind;

namespace jaxoverlap {
namespace {

void ThrowIfError(const xla::ffi::Error& e) {
  if (e.failure()) throw std::runtime_error(e.message());
}

template <typename Fn>
nb::capsule EncapsulateFfiHandler(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace
}  // namespace jaxoverlap

NB_MODULE(_jaxoverlap_cuda, m) {
  using namespace jaxoverlap;
  m.doc() = "jaxoverlap CUDA backend: XLA FFI handlers and the NVSHMEM runtime";

  // The enums the handlers decode, under the names of jaxoverlap/names.py.
  nb::enum_<all_reduce::Algorithm>(m, "AllReduceAlgorithm")
      .value("one_shot", all_reduce::Algorithm::kOneShot)
      .value("two_shot", all_reduce::Algorithm::kTwoShot)
      .value("hierarchical", all_reduce::Algorithm::kHierarchical);
  nb::enum_<all_reduce::Protocol>(m, "Protocol")
      .value("ll", all_reduce::Protocol::kLL)
      .value("simple", all_reduce::Protocol::kSimple)
      .value("lamport", all_reduce::Protocol::kLamport);
  nb::enum_<overlap::Transport>(m, "Transport")
      .value("copy_engine", overlap::Transport::kCopyEngine)
      .value("nvshmem", overlap::Transport::kNvshmem);
  nb::enum_<gemm::Precision>(m, "Precision")
      .value("default", gemm::Precision::kDefault)
      .value("highest", gemm::Precision::kHighest);

  // The compile-time limits of the kernels and the heap layout (runtime.h).
  m.def("limits", []() {
    nb::dict d;
    d["max_group_size"] = kMaxGroupSize;
    d["max_nodes"] = kMaxNodes;
    d["max_pes"] = kMaxPes;
    d["max_chunks"] = kMaxChunks;
    d["max_blocks"] = kMaxBlocks;
    return d;
  });

  m.def("registrations", []() {
    nb::dict d;
    d["jaxoverlap_all_reduce"] = EncapsulateFfiHandler(JaxoverlapAllReduce);
    d["jaxoverlap_all_reduce_reduce_scatter"] =
        EncapsulateFfiHandler(JaxoverlapAllReduceReduceScatter);
    d["jaxoverlap_all_reduce_all_gather"] = EncapsulateFfiHandler(JaxoverlapAllReduceAllGather);
    d["jaxoverlap_all_reduce_rms_norm"] = EncapsulateFfiHandler(JaxoverlapAllReduceRmsNorm);
    d["jaxoverlap_launch_floor"] = EncapsulateFfiHandler(JaxoverlapLaunchFloor);
    d["jaxoverlap_launch_floor_pdl"] = EncapsulateFfiHandler(JaxoverlapLaunchFloorPdl);
    d["jaxoverlap_launch_floor_bookkeeping"] =
        EncapsulateFfiHandler(JaxoverlapLaunchFloorBookkeeping);
    d["jaxoverlap_launch_floor_prefetch"] = EncapsulateFfiHandler(JaxoverlapLaunchFloorPrefetch);
    d["jaxoverlap_launch_floor_shaped"] = EncapsulateFfiHandler(JaxoverlapLaunchFloorShaped);
    d["jaxoverlap_all_gather_matmul"] = EncapsulateFfiHandler(JaxoverlapAllGatherMatmul);
    d["jaxoverlap_all_gather_matmul_gathered"] =
        EncapsulateFfiHandler(JaxoverlapAllGatherMatmulGathered);
    d["jaxoverlap_matmul_reduce_scatter"] = EncapsulateFfiHandler(JaxoverlapMatmulReduceScatter);
    d["jaxoverlap_matmul_all_reduce"] = EncapsulateFfiHandler(JaxoverlapMatmulAllReduce);
    d["jaxoverlap_all_gather_matmul_cmdbuf"] =
        EncapsulateFfiHandler(JaxoverlapAllGatherMatmulCmdBuffer);
    d["jaxoverlap_all_gather_matmul_gathered_cmdbuf"] =
        EncapsulateFfiHandler(JaxoverlapAllGatherMatmulGatheredCmdBuffer);
    d["jaxoverlap_matmul_reduce_scatter_cmdbuf"] =
        EncapsulateFfiHandler(JaxoverlapMatmulReduceScatterCmdBuffer);
    d["jaxoverlap_matmul_all_reduce_cmdbuf"] =
        EncapsulateFfiHandler(JaxoverlapMatmulAllReduceCmdBuffer);
    return d;
  });

  m.def("get_unique_id", []() {
    std::string id;
    ThrowIfError(GetUniqueId(&id));
    return nb::bytes(id.data(), id.size());
  });

  m.def(
      "initialize",
      [](nb::bytes unique_id, int rank, int num_ranks, int device, size_t heap_bytes,
         size_t overlap_heap_bytes, uint64_t timeout_ns, int ranks_per_node) {
        std::string id(static_cast<const char*>(unique_id.data()), unique_id.size());
        // Without the GIL: the caller bounds this call from another thread.
        nb::gil_scoped_release release;
        ThrowIfError(Initialize(id, rank, num_ranks, device, heap_bytes, overlap_heap_bytes,
                                timeout_ns, ranks_per_node));
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("device"),
      nb::arg("heap_bytes"), nb::arg("overlap_heap_bytes"), nb::arg("timeout_ns"),
      nb::arg("ranks_per_node"));

  m.def(
      "initialize_peer",
      [](std::vector<int> devices, int first_pe, int num_pes, size_t heap_bytes,
         size_t overlap_heap_bytes, uint64_t timeout_ns) {
        nb::gil_scoped_release release;
        ThrowIfError(InitializePeer(devices.data(), static_cast<int>(devices.size()), first_pe,
                                    num_pes, heap_bytes, overlap_heap_bytes, timeout_ns));
      },
      nb::arg("devices"), nb::arg("first_pe"), nb::arg("num_pes"), nb::arg("heap_bytes"),
      nb::arg("overlap_heap_bytes"), nb::arg("timeout_ns"));

  m.def(
      "heap_layout",
      [](int num_pes, int ranks_per_node, size_t heap_bytes, size_t overlap_heap_bytes) {
        HeapSizes h;
        ThrowIfError(
            ComputeHeapLayout(num_pes, ranks_per_node, heap_bytes, overlap_heap_bytes, &h));
        nb::dict d;
        d["slot_bytes"] = h.slot_bytes;
        d["ll_slot_bytes"] = h.ll_slot_bytes;
        d["lamport_slot_bytes"] = h.lamport_slot_bytes;
        d["overlap_slot_bytes"] = h.overlap_slot_bytes;
        return d;
      },
      nb::arg("num_pes"), nb::arg("ranks_per_node"), nb::arg("heap_bytes"),
      nb::arg("overlap_heap_bytes"));

  m.def("finalize", []() { ThrowIfError(Finalize()); });
  m.def("init_stage", []() { return std::string(InitStage()); });
  m.def("synchronize", []() { ThrowIfError(Synchronize()); });

  m.def("info", []() {
    const RuntimeState& s = State();
    nb::dict d;
    d["initialized"] = s.initialized;
    d["mode"] = RuntimeMode() == Mode::kPeer      ? "peer"
                : RuntimeMode() == Mode::kNvshmem ? "nvshmem"
                                                  : "none";
    d["num_local_devices"] = NumLocalDevices();
    d["pe"] = s.my_pe;
    d["num_pes"] = s.num_pes;
    d["device"] = s.device;
    d["heap_bytes"] = s.heap_bytes;
    d["slot_bytes"] = s.slot_bytes;
    d["ll_slot_bytes"] = s.ll_slot_bytes;
    d["lamport_slot_bytes"] = s.lamport_slot_bytes;
    d["lamport_blocks_per_sm"] = s.lamport_blocks_per_sm;
    d["ranks_per_node"] = s.ranks_per_node;
    d["force_nvshmem_put"] = s.force_put;
    d["hierarchical_ll_kernel"] = all_reduce::HierarchicalLLKernelName();
    d["epochs_at_start"] = all_reduce::EpochsAtStart();
    d["norm_blocks_per_row"] = all_reduce::NormBlocksPerRowKnob();
    d["timeout_ns"] = s.timeout_ns;
    d["overlap_heap_bytes"] = s.overlap_bytes;
    d["overlap_slot_bytes"] = s.overlap_slot_bytes;
    d["gemm_plans"] = gemm::CachedPlans();
    nb::list unreachable;
    for (int pe : all_reduce::UnreachableLocalPes(s)) unreachable.append(pe);
    d["unreachable_local_pes"] = unreachable;
    return d;
  });

  // A device wait that failed, else a call that failed half-way (RecordBrokenCall):
  // either keeps every later call out, and finalize() from NVSHMEM's barrier.
  m.def("device_error", []() -> nb::object {
    int pe = -1;
    const DeviceError e = LastDeviceError(&pe);
    if (e.code != 0) return nb::str(DeviceErrorToFfi(e, pe).message().c_str());
    if (const std::string broken = BrokenCall(); !broken.empty()) return nb::str(broken.c_str());
    return nb::none();
  });
}
