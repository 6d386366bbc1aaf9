// How much a copy-engine copy of a fused op's bytes slows a concurrent GEMM on one GPU (HBM
// contention), and the GEMM the copy.
//
// Problem: a fused op (CommFuse, arXiv 2604.24013, section 3) hides its transfer under a shard
// GEMM. On each GPU of a 2-rank all_gather_matmul the copy engines read the shard it sends
// (64 MiB at (16384, 4096, 4096), bf16) from its HBM and write the peer's shard into it: 64 MiB
// read and 64 MiB written beside the GEMM, the HBM traffic of one 64 MiB device-to-device copy.
// benchmarks/fused_contention.py measures the real thing from traces on two GPUs; this program
// asks one GPU how much of the slowdown HBM sharing alone can explain, with CUDA and cuBLASLt
// only (no XLA, no NVLink, no SM taken by the copy).
//
// Method: a bf16 GEMM D = A @ B (column-major M x K times K x N, fp32 accumulation, cuBLASLt's
// first heuristic plan, 32 MiB workspace) on one stream, a cudaMemcpyAsync device-to-device of
// BYTES on another. Each rep runs, in turn:
//   * gemm:      the GEMM alone;
//   * copy:      the copy alone;
//   * both:      the copy and the GEMM started together; each timed by events on its own
//                stream;
//   * saturated: the GEMM beside as many back-to-back copies as cover it (from the alone
//                times of the warm-up), so every microsecond of the GEMM shares HBM: an upper
//                bound of the slowdown per byte; an event after each copy gives the copy rate
//                while the GEMM ran (the copies that ended inside it) and the bytes it moved.
//   * sleepers:  the copy beside a kernel that fills every SM's thread slots and sleeps for
//                200 us: whether the copy needs SMs (then it waits) or runs on a copy engine.
// Every run starts behind a 100 us gate kernel, so that the GEMM and the first copy start
// together (cuBLASLt's host-side launch would otherwise let the copy run ahead). Median over
// REPS reps after WARMUP. The copy's destination is compared with its source, and
// 256 entries of D with a float64 host product of the same bf16 inputs, after the timed runs.
// Output: one JSON line per GEMM shape.
//
// Build and run (one GPU; scripts/gpu_check.sh hbmprobe does both):
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/hbm_probe benchmarks/hbm_contention_probe.cu \
//       -lcublasLt
//   /tmp/hbm_probe M K N BYTES REPS WARMUP MODE
//   e.g. /tmp/hbm_probe 8192 4096 2048 67108864 30 5 ce   (all_gather_matmul's own-shard GEMM,
//   one rank of 2 at (16384, 4096, 4096), beside its 64 MiB shard)
// MODE: how the copy is issued. plain: cudaMemcpyAsync, which for a copy within one device the
// driver may run as a kernel on the SMs (then it waits for SMs the GEMM holds: SM contention,
// not HBM); ce: cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, the driver's
// hint to put the copy where it overlaps compute (a copy engine), as a copy to a peer GPU is.

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CUDA_CHECK(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                   \
                   cudaGetErrorString(e_));                                             \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)
#define LT_CHECK(x)                                                                     \
  do {                                                                                  \
    cublasStatus_t s_ = (x);                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                  \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #x,     \
                   static_cast<int>(s_));                                               \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Gemm {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulAlgo_t algo;
  void* workspace;
  size_t workspace_bytes = size_t{32} << 20;

  Gemm(int64_t m, int64_t k, int64_t n) {
    LT_CHECK(cublasLtCreate(&handle));
    LT_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, m, k, m));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, n, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, m, n, m));
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
        sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, 1, &result,
                                            &found));
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt found no plan for %ld x %ld x %ld\n", long(m), long(k),
                   long(n));
      std::exit(1);
    }
    algo = result.algo;
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  }

  void Run(const void* pa, const void* pb, void* pd, cudaStream_t s) {
    float one = 1.f, zero = 0.f;
    LT_CHECK(cublasLtMatmul(handle, desc, &one, pa, a, pb, b, &zero, pd, d, pd, d, &algo,
                            workspace, workspace_bytes, s));
  }
};

// One device-to-device copy: plain, cudaMemcpyAsync (the driver may run a same-device copy as a
// kernel on the SMs), or ce, cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute
// (the driver's hint to overlap it with compute, i.e. to use a copy engine).
void Copy(bool ce, void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (!ce) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
  void* dsts[1] = {dst};
  const void* srcs[1] = {src};
  size_t sizes[1] = {bytes};
  CUDA_CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &attr_index, 1, s));
}

// Holds a stream for a while, so that work enqueued behind it (on it and on streams waiting for
// an event after it) starts together once it ends.
constexpr unsigned kGateNs = 100000;  // 100 us: longer than enqueueing a GEMM and the copies
__global__ void SpinKernel(unsigned ns) {
  for (unsigned spent = 0; spent < ns; spent += 1000) __nanosleep(1000);
}

float Bf16ToFloat(uint16_t h) {
  uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    float f = dist(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<uint16_t>(u >> 16);  // truncation: any bf16 value will do
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s M K N BYTES REPS WARMUP plain|ce\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[7];
  if (mode != "plain" && mode != "ce") {
    std::fprintf(stderr, "the copy mode is plain or ce, not %s\n", mode.c_str());
    return 2;
  }
  const int64_t m = std::atoll(argv[1]), k = std::atoll(argv[2]), n = std::atoll(argv[3]);
  const size_t bytes = std::strtoull(argv[4], nullptr, 10);
  const int reps = std::atoi(argv[5]), warmup = std::atoi(argv[6]);
  if (m <= 0 || k <= 0 || n <= 0 || bytes == 0 || bytes % 16 || reps <= 0 || warmup < 1) {
    std::fprintf(stderr, "M, K, N > 0; BYTES > 0, a multiple of 16; REPS > 0; WARMUP >= 1\n");
    return 2;
  }
  std::mt19937_64 rng(0);
  std::vector<uint16_t> ha = RandomBf16(m * k, rng), hb = RandomBf16(k * n, rng);
  std::vector<uint8_t> hsrc(bytes);
  for (size_t i = 0; i < bytes; ++i) hsrc[i] = static_cast<uint8_t>(rng());

  void *da, *db, *dd, *src, *dst;
  CUDA_CHECK(cudaMalloc(&da, m * k * 2));
  CUDA_CHECK(cudaMalloc(&db, k * n * 2));
  CUDA_CHECK(cudaMalloc(&dd, m * n * 2));
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemcpy(da, ha.data(), m * k * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(db, hb.data(), k * n * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(src, hsrc.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dd, 0xff, m * n * 2));  // poison: NaN in bf16
  CUDA_CHECK(cudaMemset(dst, 0, bytes));

  Gemm gemm(m, k, n);
  cudaStream_t s_gemm, s_copy;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s_gemm, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&s_copy, cudaStreamNonBlocking));
  constexpr int kMaxCopies = 64;
  cudaEvent_t g0, g1, c0, gate;
  std::vector<cudaEvent_t> c_end(kMaxCopies);
  for (cudaEvent_t* e : {&g0, &g1, &c0, &gate}) CUDA_CHECK(cudaEventCreate(e));
  for (auto& e : c_end) CUDA_CHECK(cudaEventCreate(&e));

  auto elapsed_us = [](cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return 1000.0 * ms;
  };
  struct Timing {
    double gemm_us = 0;       // the GEMM, start to end
    double copy_us = 0;       // the first copy, start to end
    double during_gb_s = 0;   // copy rate while the GEMM ran (the copies that ended inside it)
    double during_gib = 0;    // GiB copied while the GEMM ran
  };
  // One timed run; copies = 0: the GEMM alone; with_gemm = false: the copies alone. A gate
  // kernel holds both streams until everything is enqueued, so the GEMM and the first copy
  // start together (the GEMM's host-side launch would otherwise let the copy run ahead).
  auto run = [&](bool with_gemm, int copies) {
    Timing t;
    SpinKernel<<<1, 1, 0, s_gemm>>>(kGateNs);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(gate, s_gemm));
    CUDA_CHECK(cudaStreamWaitEvent(s_copy, gate, 0));
    if (copies > 0) {
      CUDA_CHECK(cudaEventRecord(c0, s_copy));
      for (int i = 0; i < copies; ++i) {
        Copy(mode == "ce", dst, src, bytes, s_copy);
        CUDA_CHECK(cudaEventRecord(c_end[i], s_copy));
      }
    }
    if (with_gemm) {
      CUDA_CHECK(cudaEventRecord(g0, s_gemm));
      gemm.Run(da, db, dd, s_gemm);
      CUDA_CHECK(cudaEventRecord(g1, s_gemm));
    }
    CUDA_CHECK(cudaStreamSynchronize(s_copy));
    CUDA_CHECK(cudaStreamSynchronize(s_gemm));
    CUDA_CHECK(cudaGetLastError());
    if (with_gemm) t.gemm_us = elapsed_us(g0, g1);
    if (copies > 0) t.copy_us = elapsed_us(c0, c_end[0]);
    if (with_gemm && copies > 0) {
      int inside = 0;
      double last = 0;
      for (int i = 0; i < copies; ++i) {
        double end_us = elapsed_us(g0, c_end[i]);
        if (end_us > t.gemm_us) break;
        inside = i + 1;
        last = end_us;
      }
      t.during_gib = inside * double(bytes) / double(1 << 30);
      t.during_gb_s = inside > 0 ? inside * double(bytes) / last / 1e3 : 0;
    }
    return t;
  };

  std::vector<double> w_gemm, w_copy;
  for (int i = 0; i < warmup; ++i) {
    w_gemm.push_back(run(true, 0).gemm_us);
    w_copy.push_back(run(false, 1).copy_us);
  }
  const int saturating = std::min(
      kMaxCopies, std::max(1, static_cast<int>(std::ceil(Median(w_gemm) / Median(w_copy))) + 1));
  if (double(saturating) * Median(w_copy) < Median(w_gemm)) {
    std::fprintf(stderr, "%d copies do not cover the GEMM; use more BYTES\n", kMaxCopies);
    return 2;
  }

  // Does the copy need SMs? The copy beside a kernel that fills every SM's thread slots and
  // sleeps for 200 us (no memory traffic): a copy engine's copy keeps its time, a copy run as a
  // kernel waits for the sleepers.
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto copy_beside_sleepers = [&]() {
    SpinKernel<<<1, 1, 0, s_gemm>>>(kGateNs);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(gate, s_gemm));
    CUDA_CHECK(cudaStreamWaitEvent(s_copy, gate, 0));
    CUDA_CHECK(cudaEventRecord(c0, s_copy));
    Copy(mode == "ce", dst, src, bytes, s_copy);
    CUDA_CHECK(cudaEventRecord(c_end[0], s_copy));
    SpinKernel<<<2 * sms, 1024, 0, s_gemm>>>(200000);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaStreamSynchronize(s_copy));
    CUDA_CHECK(cudaStreamSynchronize(s_gemm));
    return elapsed_us(c0, c_end[0]);
  };

  std::vector<double> gemm_alone, copy_alone, gemm_both, copy_both, gemm_sat, sat_gb_s, sat_gib;
  std::vector<double> copy_sleepers;
  for (int r = 0; r < reps; ++r) {
    gemm_alone.push_back(run(true, 0).gemm_us);
    copy_alone.push_back(run(false, 1).copy_us);
    Timing both = run(true, 1);
    gemm_both.push_back(both.gemm_us);
    copy_both.push_back(both.copy_us);
    Timing sat = run(true, saturating);
    gemm_sat.push_back(sat.gemm_us);
    sat_gb_s.push_back(sat.during_gb_s);
    sat_gib.push_back(sat.during_gib);
    copy_sleepers.push_back(copy_beside_sleepers());
  }

  // Checks: the copy is exact; D against a float64 product of the same bf16 inputs.
  std::vector<uint8_t> hdst(bytes);
  CUDA_CHECK(cudaMemcpy(hdst.data(), dst, bytes, cudaMemcpyDeviceToHost));
  const bool copy_ok = std::memcmp(hdst.data(), hsrc.data(), bytes) == 0;
  std::vector<uint16_t> hd(m * n);
  CUDA_CHECK(cudaMemcpy(hd.data(), dd, m * n * 2, cudaMemcpyDeviceToHost));
  double max_rel = 0;
  for (int t = 0; t < 256; ++t) {
    int64_t i = static_cast<int64_t>(rng() % m), j = static_cast<int64_t>(rng() % n);
    double ref = 0, scale = 0;
    for (int64_t p = 0; p < k; ++p) {
      double x = Bf16ToFloat(ha[p * m + i]) * double(Bf16ToFloat(hb[j * k + p]));
      ref += x;
      scale += std::fabs(x);
    }
    double got = Bf16ToFloat(hd[j * m + i]);
    max_rel = std::max(max_rel, std::fabs(got - ref) / std::max(scale, 1e-30));
  }
  const bool gemm_ok = std::isfinite(max_rel) && max_rel < 1e-2;  // bf16 output rounding

  const double ga = Median(gemm_alone), ca = Median(copy_alone);
  const double gb = Median(gemm_both), cb = Median(copy_both);
  const double gs = Median(gemm_sat), rate = Median(sat_gb_s), gib = Median(sat_gib);
  int dev;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf(
      "{\"device\": \"%s\", \"copy_mode\": \"%s\", \"m\": %ld, \"k\": %ld, \"n\": %ld, \"copy_bytes\": %zu, "
      "\"reps\": %d, \"warmup\": %d, "
      "\"gemm_alone_us\": %.2f, \"copy_alone_us\": %.2f, \"copy_alone_gb_s\": %.1f, "
      "\"gemm_beside_copy_us\": %.2f, \"copy_beside_gemm_us\": %.2f, "
      "\"gemm_slowdown\": %.4f, \"copy_slowdown\": %.4f, "
      "\"copy_beside_sm_sleepers_us\": %.2f, "
      "\"saturating_copies\": %d, \"gemm_saturated_us\": %.2f, "
      "\"gemm_slowdown_saturated\": %.4f, \"copy_gb_s_during_gemm_saturated\": %.1f, "
      "\"gib_copied_during_gemm_saturated\": %.3f, \"gemm_us_per_gib_copied_saturated\": %.2f, "
      "\"copy_exact\": %s, \"gemm_max_rel_err\": %.2e, \"gemm_ok\": %s}\n",
      prop.name, mode.c_str(), long(m), long(k), long(n), bytes, reps, warmup, ga, ca, bytes / ca / 1e3,
      gb, cb, gb / ga - 1, cb / ca - 1, Median(copy_sleepers), saturating, gs, gs / ga - 1, rate, gib,
      gib > 0 ? (gs - ga) / gib : 0.0, copy_ok ? "true" : "false", max_rel,
      gemm_ok ? "true" : "false");
  return copy_ok && gemm_ok ? 0 : 1;
}
