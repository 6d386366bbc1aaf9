// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// Row-major GEMMs through cuBLASLt for the fused ops: D[b] = A[b] @ B (+ C[b]
// when C is given), b < batch, fp32 accumulation and one rounding. The fused ops never write a
// GEMM of their own: they cut the problem into shard GEMMs and hand each to
// cuBLASLt, on XLA's stream.
//
// Plans (matmul descriptor, layouts, the heuristic's algorithm) are cached per
// shape, leading dimensions, batch strides, pointer alignment and precision,
// so an execution during CUDA-graph capture only enqueues the matmul. The
// workspace is allocated once at start-up (no allocation per call).
#ifndef JAXOVERLAP_GEMM_H_
#define JAXOVERLAP_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxoverlap::gemm {

namespace ffi = xla::ffi;

// How float32 GEMMs round their inputs (the JAX matmul precision setting).
enum class Precision : int32_t {
  kDefault = 0,  // TF32 tensor cores, as XLA runs f32 dots of precision DEFAULT/HIGH on GPUs
  kHighest = 1,  // full float32, as XLA runs precision HIGHEST
};

// One row-major GEMM: A [rows, k] (row stride lda elements), B [k, n] (row
// stride ldb), D [rows, n] (row stride ldd); `batch` of them, A and D advance
// by stride_a / stride_d elements per batch, B is shared. C, when given, has
// D's layout (ldd, stride_d) and is added before the one rounding to D's type.
struct Gemm {
  int device = 0;                              // the GPU (CUDA ordinal) of `stream`
  ffi::DataType dtype = ffi::DataType::BF16;  // A, B and D
  Precision precision = Precision::kDefault;   // float32 only
  int64_t rows = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_d = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* c = nullptr;  // D = A @ B + C when not null
};

// Creates the cuBLASLt handle and the workspace of GPU `device`; once per GPU.
ffi::Error Init(int device);
// Releases them (at finalisation); every release runs, the first failure is returned.
ffi::Error Shutdown();
// Enqueues `g` on `stream` (a stream of GPU g.device). A GEMM with rows, n or
// batch 0 is a no-op; k must be positive (the ops handle empty operands before
// any kernel).
ffi::Error Run(cudaStream_t stream, const Gemm& g);
// Checks `g` and finds or makes its plan, enqueuing nothing: a GEMM that
// cuBLASLt cannot run fails here. The fused ops plan every GEMM of a call
// before the first runs (a refused call leaves no output partly written).
ffi::Error Plan(const Gemm& g);
// Runs `g` now if its plan has never run on this GPU, so that cuBLASLt's
// kernel for it is loaded; otherwise does nothing. CUDA loads kernels lazily
// (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2), and loading one may
// wait for every kernel running on the GPU: a first GEMM enqueued behind a
// kernel that waits for a peer would wait for that peer, and the peer may be
// waiting for this GPU in turn. The fused ops therefore preload every GEMM of
// a call before their first wait (docs/kernels.md, "Lazy loading"). `g` must
// be safe to run early: its D is not read by anyone before the call rewrites it.
// Under stream capture it enqueues nothing (a graph loads its kernels when it
// is instantiated or updated), but still checks `g` and makes its plan. Either
// way a GEMM that cannot run fails here.
ffi::Error Preload(cudaStream_t stream, const Gemm& g);
// Plans cached so far (for runtime_info and tests).
int64_t CachedPlans();

}  // namespace jaxoverlap::gemm

#endif  // JAXOVERLAP_GEMM_H_
