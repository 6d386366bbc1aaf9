// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// cuBLASLt behind jaxoverlap::gemm (gemm.h). Row-major D = A @ B is the
// column-major D^T = B^T A^T, so cuBLASLt's "A" is our B and its "B" our A;
// no transposes, no copies.
#include "jaxoverlap/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "jaxoverlap/check.h"
#include "jaxoverlap/runtime.h"

namespace jaxoverlap::gemm {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A, B, C=D
  cublasLtMatmulAlgo_t algo{};
  bool launched = false;  // its kernel has been launched once (is loaded: see Preload)
};

using Key = std::array<int64_t, 16>;

// One cuBLASLt handle and workspace per GPU (the handlers of a process's GPUs
// run concurrently); one plan cache for all, keyed by the GPU too.
struct PerDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

struct State {
  std::mutex mu;
  PerDevice devices[kMaxDevices];
  std::map<Key, Plan> plans;
};

State& S() {
  static State* s = new State();  // never destroyed: handlers may run at exit
  return *s;
}

ffi::Error BlasError(cublasStatus_t st, const char* expr, const char* file, int line) {
  return ffi::Error(ffi::ErrorCode::kInternal, Where(file, line) + expr + " failed: " +
                                                   cublasLtGetStatusName(st) + ": " +
                                                   cublasLtGetStatusString(st));
}

#define JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(expr)                            \
  do {                                                                     \
    cublasStatus_t jaxoverlap_st_ = (expr);                                \
    if (jaxoverlap_st_ != CUBLAS_STATUS_SUCCESS) {                         \
      return BlasError(jaxoverlap_st_, #expr, __FILE__, __LINE__);         \
    }                                                                      \
  } while (0)

// The most alignment (bytes) a plan assumes: 16, what cuBLASLt's tensor-core
// kernels need. A precaution for CUDA graphs: with
// JAXOVERLAP_FUSED_CMD_BUFFER=1, XLA records the fused calls into its graphs
// and updates them in place for new addresses, which needs the same kernel
// sequence; a plan chosen by where XLA placed a buffer could change it. XLA's
// buffers are at least 16-byte aligned, so plans depend on the shapes only.
// (It was not the cause of the update failures seen so far: docs/kernels.md,
// "CUDA graphs".)
// JAXOVERLAP_GEMM_ALIGNMENT_CAP (a power of two, 1..256) overrides it; Init()
// rejects other values, and jaxoverlap.initialize() checks them first.
int64_t ParseAlignmentCap() {
  const char* env = std::getenv("JAXOVERLAP_GEMM_ALIGNMENT_CAP");
  if (env == nullptr) return 16;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  return (end != env && *end == '\0' && v >= 1 && v <= 256 && (v & (v - 1)) == 0) ? v : 0;
}

int64_t AlignmentCap() {
  static const int64_t cap = ParseAlignmentCap();
  return cap;
}

// The alignment of `p` (bytes, up to AlignmentCap()) that the plan may assume.
int64_t Alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = AlignmentCap();
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

ffi::Error ElementType(ffi::DataType t, Precision precision, cudaDataType_t* data,
                       cublasComputeType_t* compute) {
  switch (t) {
    case ffi::DataType::F32:
      *data = CUDA_R_32F;
      *compute = precision == Precision::kHighest ? CUBLAS_COMPUTE_32F
                                                  : CUBLAS_COMPUTE_32F_FAST_TF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *data = CUDA_R_16BF;
      *compute = CUBLAS_COMPUTE_32F;
      return ffi::Error::Success();
    case ffi::DataType::F16:
      *data = CUDA_R_16F;
      *compute = CUBLAS_COMPUTE_32F;
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("gemm: unsupported element type " +
                                         std::to_string(static_cast<int>(t)) +
                                         " (float32, bfloat16 and float16 are supported)");
  }
}

ffi::Error SetLayout(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride) {
  int32_t count = static_cast<int32_t>(batch);
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  return ffi::Error::Success();
}

// Builds the plan for `key`'s GEMM (called with the state's lock held).
ffi::Error MakePlan(const Gemm& g, cublasLtHandle_t handle, Plan* plan) {
  cudaDataType_t data;
  cublasComputeType_t compute;
  JAXOVERLAP_RETURN_IF_ERROR(ElementType(g.dtype, g.precision, &data, &compute));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F));
  const cublasOperation_t no_transpose = CUBLAS_OP_N;
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &no_transpose, sizeof(no_transpose)));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)));
  // Column-major: cuBLASLt A = our B (n x k, ld ldb), B = our A (k x rows,
  // ld lda), D = our D (n x rows, ld ldd).
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, data, g.n, g.k, g.ldb));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, data, g.k, g.rows, g.lda));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->d, data, g.n, g.rows, g.ldd));
  if (g.batch > 1) {
    JAXOVERLAP_RETURN_IF_ERROR(SetLayout(plan->a, g.batch, 0));
    JAXOVERLAP_RETURN_IF_ERROR(SetLayout(plan->b, g.batch, g.stride_a));
    JAXOVERLAP_RETURN_IF_ERROR(SetLayout(plan->d, g.batch, g.stride_d));
  }
  cublasLtMatmulPreference_t pref;
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t align_a = static_cast<uint32_t>(Alignment(g.b));
  const uint32_t align_b = static_cast<uint32_t>(Alignment(g.a));
  const uint32_t align_d = static_cast<uint32_t>(Alignment(g.d));
  const uint32_t align_c = static_cast<uint32_t>(g.c != nullptr ? Alignment(g.c) : Alignment(g.d));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                              &align_a, sizeof(align_a));
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                              &align_b, sizeof(align_b));
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                              &align_c, sizeof(align_c));
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                              &align_d, sizeof(align_d));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                        pref, 1, &result, &found);
  }
  const cublasStatus_t destroyed = cublasLtMatmulPreferenceDestroy(pref);
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(st);
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(destroyed);
  if (found == 0) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "gemm: cuBLASLt has no algorithm for [" + std::to_string(g.rows) + ", " +
                          std::to_string(g.k) + "] @ [" + std::to_string(g.k) + ", " +
                          std::to_string(g.n) + "] (batch " + std::to_string(g.batch) +
                          ", alignments " + std::to_string(align_b) + "/" +
                          std::to_string(align_a) + "/" + std::to_string(align_d) + " bytes)");
  }
  plan->algo = result.algo;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Init(int device) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error::InvalidArgument("gemm: CUDA device " + std::to_string(device) +
                                       " is outside [0, " + std::to_string(kMaxDevices) + ")");
  }
  PerDevice& d = s.devices[device];
  if (d.handle != nullptr) return ffi::Error::Success();
  if (AlignmentCap() == 0) {
    return ffi::Error::InvalidArgument(
        "JAXOVERLAP_GEMM_ALIGNMENT_CAP must be a power of two from 1 to 256 (bytes)");
  }
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&d.handle));
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&d.workspace, kWorkspaceBytes));
  return ffi::Error::Success();
}

ffi::Error Shutdown() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  FirstError first;
  auto blas = [&](cublasStatus_t st, const char* what) {
    if (st != CUBLAS_STATUS_SUCCESS) first.Add(BlasError(st, what, __FILE__, __LINE__));
  };
  for (auto& [key, p] : s.plans) {
    blas(cublasLtMatrixLayoutDestroy(p.a), "cublasLtMatrixLayoutDestroy (A)");
    blas(cublasLtMatrixLayoutDestroy(p.b), "cublasLtMatrixLayoutDestroy (B)");
    blas(cublasLtMatrixLayoutDestroy(p.d), "cublasLtMatrixLayoutDestroy (D)");
    blas(cublasLtMatmulDescDestroy(p.desc), "cublasLtMatmulDescDestroy");
  }
  s.plans.clear();
  for (int device = 0; device < kMaxDevices; ++device) {
    PerDevice& d = s.devices[device];
    if (d.handle == nullptr) continue;
    const std::string on = " (cuBLASLt of GPU " + std::to_string(device) + ")";
    first.Cuda(cudaSetDevice(device), "cudaSetDevice" + on);
    if (d.workspace != nullptr) first.Cuda(cudaFree(d.workspace), "cudaFree (workspace)" + on);
    blas(cublasLtDestroy(d.handle), "cublasLtDestroy");
    d = PerDevice();
  }
  return first.Take();
}

int64_t CachedPlans() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int64_t>(s.plans.size());
}

namespace {

enum class When {
  kAlways,      // enqueue `g`
  kFirstOnly,   // enqueue it only when its plan has never been launched
  kNever,       // only check it and make its plan
};

// Checks `g`, finds or makes its plan, and enqueues it on `stream` as `when` says.
ffi::Error Launch(cudaStream_t stream, const Gemm& g, When when) {
  if (g.rows == 0 || g.n == 0 || g.batch == 0) return ffi::Error::Success();
  if (g.k <= 0 || g.rows < 0 || g.n < 0 || g.batch < 0 || g.lda < g.k || g.ldb < g.n ||
      g.ldd < g.n) {
    return ffi::Error::InvalidArgument(
        "gemm: bad shape rows=" + std::to_string(g.rows) + " n=" + std::to_string(g.n) +
        " k=" + std::to_string(g.k) + " lda=" + std::to_string(g.lda) + " ldb=" +
        std::to_string(g.ldb) + " ldd=" + std::to_string(g.ldd));
  }
  State& s = S();
  if (g.device < 0 || g.device >= kMaxDevices) {
    return ffi::Error::InvalidArgument("gemm: CUDA device " + std::to_string(g.device) +
                                       " is outside [0, " + std::to_string(kMaxDevices) + ")");
  }
  const Plan* plan = nullptr;
  PerDevice d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    d = s.devices[g.device];
    if (d.handle == nullptr) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "gemm: cuBLASLt is not initialised on GPU " + std::to_string(g.device) +
                            " (jaxoverlap.initialize() first)");
    }
    const Key key = {static_cast<int64_t>(g.dtype), static_cast<int64_t>(g.precision),
                     g.rows, g.n, g.k, g.lda, g.ldb, g.ldd, g.batch, g.stride_a, g.stride_d,
                     Alignment(g.a), Alignment(g.b), Alignment(g.d),
                     g.c != nullptr ? Alignment(g.c) : 0, g.device};
    auto it = s.plans.find(key);
    if (it == s.plans.end()) {
      Plan p;
      ffi::Error e = MakePlan(g, d.handle, &p);
      if (e.failure()) {
        if (p.a) cublasLtMatrixLayoutDestroy(p.a);
        if (p.b) cublasLtMatrixLayoutDestroy(p.b);
        if (p.d) cublasLtMatrixLayoutDestroy(p.d);
        if (p.desc) cublasLtMatmulDescDestroy(p.desc);
        return e;
      }
      it = s.plans.emplace(key, p).first;
    }
    if (when == When::kNever || (when == When::kFirstOnly && it->second.launched)) {
      return ffi::Error::Success();
    }
    it->second.launched = true;
    plan = &it->second;  // std::map nodes are stable
  }
  const float alpha = 1.0f;
  const float beta = g.c != nullptr ? 1.0f : 0.0f;
  const void* c = g.c != nullptr ? g.c : g.d;
  JAXOVERLAP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(
      d.handle, plan->desc, &alpha, g.b, plan->a, g.a, plan->b, &beta, c, plan->d, g.d,
      plan->d, &plan->algo, d.workspace, kWorkspaceBytes, stream));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Run(cudaStream_t stream, const Gemm& g) { return Launch(stream, g, When::kAlways); }

ffi::Error Plan(const Gemm& g) { return Launch(nullptr, g, When::kNever); }

ffi::Error Preload(cudaStream_t stream, const Gemm& g) {
  // Under stream capture (XLA's command buffers) nothing runs now, and a graph
  // loads its kernels when it is instantiated or updated, not half-way through
  // a launch. A preload node would also change the recorded topology between the
  // first capture and later ones, which a graph update refuses. The plan is
  // made all the same, so that a GEMM cuBLASLt cannot run fails here, before
  // the call's first transfer, and not half-way through a recorded call.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAXOVERLAP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  return Launch(stream, g, capture != cudaStreamCaptureStatusNone ? When::kNever
                                                                  : When::kFirstOnly);
}

}  // namespace jaxoverlap::gemm
