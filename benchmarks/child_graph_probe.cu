// What a kernel costs in a CUDA graph as a kernel node, and as a child-graph node.
//
// Problem: inside XLA's CUDA graphs an FFI custom call's kernel is recorded by capturing the
// call's stream into a graph of its own and adding that graph to XLA's as a child node
// (XLA's CustomCallCmd), where XLA's own kernels (fusions, Pallas/Triton kernels) are kernel
// nodes. benchmarks/launch_floor_pdl.py measured a one-kernel custom call at about 1 us more
// per call than an XLA kernel doing the same copy. This program asks CUDA alone, with no XLA:
// does a kernel cost more as a child-graph node?
//
// Method: one graph per form, a chain of CHAIN copies of BYTES (float4 loads and stores,
// THREADS a block, enough blocks for one float4 a thread up to 1024, each copy reading the
// buffer the one before wrote), replayed REPS times after 5 warm-up replays; each replay
// timed with CUDA events; the median per node. THREADS varies the block's size at the same
// work: the all-reduce kernels run 512 threads a block, XLA's small fusions and Pallas's
// Triton kernels 128.
//   * kernel:      every copy a kernel node (as XLA records its own kernels);
//   * child:       every copy a child-graph node holding one kernel node, made by stream
//                  capture and cudaGraphAddChildGraphNode (as XLA records a custom call);
//   * capture_to:  every copy captured straight into the parent graph with
//                  cudaStreamBeginCaptureToGraph (CUDA 12.3+): a kernel node again, made by
//                  capture; the way a custom call's work could be recorded without a child;
//   * alternating: kernel nodes and child-graph nodes in turn, as in XLA's graph of fusions
//                  with a custom call after each (CUDA might run an all-child graph as it
//                  does kernel nodes and still pay at the boundaries between the two).
// Before timing, each graph's output is checked against the input (a chain of copies).
//
// Build and run (one GPU; scripts/gpu_check.sh childgraph also builds it as the extension's
// code is built, -rdc=true, and with NVSHMEM's device library linked in, PROBE_WITH_NVSHMEM,
// to tell whether the module a kernel lives in changes its cost):
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/child_graph_probe benchmarks/child_graph_probe.cu
//   /tmp/child_graph_probe 8192 200 50 256 8 > out.json  # bytes, chain, reps, threads, pad
// PAD: bytes of extra kernel parameters (8, 640 or 4096; the all-reduce kernels' Params
// struct is about 650 bytes).
// Output: one JSON object (sizes, per-node medians in us, the GPU's name) on stdout.

#include <cuda_runtime.h>
#ifdef PROBE_WITH_NVSHMEM
#include <nvshmem.h>
#endif

#include <algorithm>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK(call)                                                                  \
  do {                                                                               \
    const cudaError_t err_ = (call);                                                 \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "child_graph_probe: %s failed at %s:%d: %s\n", #call,     \
                   __FILE__, __LINE__, cudaGetErrorString(err_));                    \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace {

#if defined(PROBE_WITH_NVSHMEM)
constexpr const char* kBuild = "rdc+nvshmem_device";
#elif defined(__CUDACC_RDC__)
constexpr const char* kBuild = "rdc";
#else
constexpr const char* kBuild = "whole";
#endif

// Kernel parameters of kPad bytes beside the copy's own (the all-reduce kernels take a
// Params struct of about 650 bytes by value): whether the size of a kernel's parameters
// changes its cost in a graph.
template <int kPad>
struct Pad {
  unsigned char bytes[kPad];
};

template <int kPad>
__global__ void Copy(const float4* __restrict__ in, float4* __restrict__ out, size_t n,
                     Pad<kPad> pad) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    out[i] = in[i];
  }
  if (n == 0 && threadIdx.x == 0) out[0].x = pad.bytes[kPad - 1];  // never: keeps pad a parameter
}

constexpr int kPads[] = {8, 640, 4096};

#ifdef PROBE_WITH_NVSHMEM
// Never launched: it makes the device link pull NVSHMEM's device library into this
// module, as it is in the extension's (built -rdc=true, linked with libnvshmem_device).
__global__ void UsesNvshmem(float* out) { out[0] = nvshmem_ptr(out, 0) == nullptr ? 0.f : 1.f; }
#endif

struct Chain {
  float4* buf[2];
  size_t n;  // float4 elements
  int blocks;
  int threads;
  int pad;  // one of kPads: bytes of extra kernel parameters
};

template <int kPad>
void* KernelOf() { return reinterpret_cast<void*>(Copy<kPad>); }

void* CopyFunction(int pad) {
  return pad == 8 ? KernelOf<8>() : pad == 640 ? KernelOf<640>() : KernelOf<4096>();
}

// Launches copy i of the chain on `stream` (from buf[i % 2] into buf[(i + 1) % 2]).
void LaunchCopy(const Chain& c, int i, cudaStream_t stream) {
  const float4* in = c.buf[i % 2];
  float4* out = c.buf[(i + 1) % 2];
  size_t n = c.n;
  Pad<4096> pad{};  // the kernel reads only its first c.pad bytes
  void* args[] = {&in, &out, &n, &pad};
  CHECK(cudaLaunchKernel(CopyFunction(c.pad), dim3(c.blocks), dim3(c.threads), args, 0, stream));
}

// Adds copy i as a kernel node after `prev` (none for the first); returns the node.
cudaGraphNode_t AddKernel(cudaGraph_t graph, cudaGraphNode_t prev, const Chain& c, int i) {
  const float4* in = c.buf[i % 2];
  float4* out = c.buf[(i + 1) % 2];
  size_t n = c.n;
  Pad<4096> pad{};
  void* args[] = {&in, &out, &n, &pad};
  cudaKernelNodeParams p{};
  p.func = CopyFunction(c.pad);
  p.gridDim = dim3(c.blocks);
  p.blockDim = dim3(c.threads);
  p.kernelParams = args;
  cudaGraphNode_t node;
  CHECK(cudaGraphAddKernelNode(&node, graph, prev ? &prev : nullptr, prev ? 1 : 0, &p));
  return node;
}

// Adds copy i as a child-graph node holding it (made by stream capture, as XLA records a
// custom call) after `prev`; returns the node.
cudaGraphNode_t AddChild(cudaGraph_t graph, cudaGraphNode_t prev, const Chain& c, int i,
                         cudaStream_t stream) {
  cudaGraph_t child;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  LaunchCopy(c, i, stream);
  CHECK(cudaStreamEndCapture(stream, &child));
  cudaGraphNode_t node;
  CHECK(cudaGraphAddChildGraphNode(&node, graph, prev ? &prev : nullptr, prev ? 1 : 0, child));
  CHECK(cudaGraphDestroy(child));  // the node holds a clone
  return node;
}

// The chain with copy i a child-graph node where child(i), else a kernel node.
template <typename ChildIf>
cudaGraph_t BuildChain(const Chain& c, int chain, cudaStream_t stream, ChildIf child) {
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  cudaGraphNode_t prev = nullptr;
  for (int i = 0; i < chain; ++i) {
    prev = child(i) ? AddChild(graph, prev, c, i, stream) : AddKernel(graph, prev, c, i);
  }
  return graph;
}

cudaGraph_t BuildCaptureTo(const Chain& c, int chain, cudaStream_t stream) {
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  CHECK(cudaStreamBeginCaptureToGraph(stream, graph, nullptr, nullptr, 0,
                                      cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < chain; ++i) LaunchCopy(c, i, stream);
  cudaGraph_t same;
  CHECK(cudaStreamEndCapture(stream, &same));
  if (same != graph) {
    std::fprintf(stderr, "child_graph_probe: capture to graph returned another graph\n");
    std::exit(1);
  }
  return graph;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Replays `exec` warmup + reps times; returns the median replay in us.
double TimeReplays(cudaGraphExec_t exec, cudaStream_t stream, int warmup, int reps) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(ms * 1e3);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return Median(us);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8192;
  const int chain = argc > 2 ? std::atoi(argv[2]) : 200;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 50;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 256;
  const int pad = argc > 5 ? std::atoi(argv[5]) : 8;
  const int warmup = 5;
  if (bytes == 0 || bytes % 16 || chain < 2 || reps < 1 || threads < 32 || threads > 1024 ||
      threads % 32 || std::find(std::begin(kPads), std::end(kPads), pad) == std::end(kPads)) {
    std::fprintf(stderr, "usage: child_graph_probe BYTES(multiple of 16) CHAIN(>=2) REPS(>=1) "
                 "[THREADS(32..1024, a multiple of 32) [PAD(8, 640 or 4096)]]\n");
    return 2;
  }
  Chain c{};
  c.n = bytes / 16;
  c.threads = threads;
  c.pad = pad;
  c.blocks = static_cast<int>(std::min<size_t>((c.n + threads - 1) / threads, 1024));
  CHECK(cudaMalloc(&c.buf[0], bytes));
  CHECK(cudaMalloc(&c.buf[1], bytes));
  std::vector<float> host(bytes / 4), back(bytes / 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 9973) - 4986.0f;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const char* names[] = {"kernel", "child", "capture_to", "alternating"};
  double per_node[4];
  for (int form = 0; form < 4; ++form) {
    cudaGraph_t graph =
        form == 0   ? BuildChain(c, chain, stream, [](int) { return false; })
        : form == 1 ? BuildChain(c, chain, stream, [](int) { return true; })
        : form == 2 ? BuildCaptureTo(c, chain, stream)
                    : BuildChain(c, chain, stream, [](int i) { return i % 2 == 1; });
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    // The check: after one replay the chain's last output equals the input.
    CHECK(cudaMemcpy(c.buf[0], host.data(), bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(c.buf[1], 0xFF, bytes));  // NaN: a copy that did not run shows
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpy(back.data(), c.buf[chain % 2], bytes, cudaMemcpyDeviceToHost));
    if (std::memcmp(back.data(), host.data(), bytes) != 0) {
      std::fprintf(stderr, "child_graph_probe: %s: the chain's output differs from its input\n",
                   names[form]);
      return 1;
    }
    per_node[form] = TimeReplays(exec, stream, warmup, reps) / chain;
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
  }
  cudaDeviceProp prop;
  int device = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&prop, device));
  int runtime = 0, driver = 0;
  CHECK(cudaRuntimeGetVersion(&runtime));
  CHECK(cudaDriverGetVersion(&driver));
  std::printf("{\"bytes\": %zu, \"chain\": %d, \"reps\": %d, \"threads\": %d, \"blocks\": %d, "
              "\"param_pad_bytes\": %d, \"build\": \"%s\", \"gpu\": \"%s\", "
              "\"cuda_runtime\": %d, \"cuda_driver\": %d, \"us_per_node\": {\"kernel\": %.4f, "
              "\"child\": %.4f, \"capture_to\": %.4f, \"alternating\": %.4f}}\n",
              bytes, chain, reps, c.threads, c.blocks, c.pad, kBuild, prop.name, runtime, driver,
              per_node[0], per_node[1], per_node[2], per_node[3]);
  CHECK(cudaFree(c.buf[0]));
  CHECK(cudaFree(c.buf[1]));
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
