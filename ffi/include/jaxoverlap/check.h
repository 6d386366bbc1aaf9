// Copyright 2026 The jaxoverlap Authors. SPDX-License-Identifier: Apache-2.0
//
// Error checking for CUDA and NVSHMEM calls inside FFI handlers and host
// functions. Every macro returns early with an ffi::Error whose message reads
// `file:line: <expression> failed: <name>: <string>` (the shape of jaxlib's
// AsStatus / FFI_RETURN_IF_ERROR). Handlers never throw.
#ifndef JAXOVERLAP_CHECK_H_
#define JAXOVERLAP_CHECK_H_

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxoverlap {

namespace ffi = xla::ffi;

inline std::string Where(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line) + ": ";
}

inline ffi::Error CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    Where(file, line) + expr + " failed: " + cudaGetErrorName(err) + ": " +
                        cudaGetErrorString(err));
}

// The first failure of a sequence of calls that must all run (a teardown): each
// later call runs whatever an earlier one returned, and the first error is kept.
class FirstError {
 public:
  void Add(ffi::Error e) {
    if (first_.success() && e.failure()) first_ = std::move(e);
  }
  void Cuda(cudaError_t err, const std::string& what) {
    if (err != cudaSuccess) {
      Add(ffi::Error(ffi::ErrorCode::kInternal, what + " failed: " + cudaGetErrorName(err) +
                                                    ": " + cudaGetErrorString(err)));
    }
  }
  ffi::Error Take() { return std::move(first_); }

 private:
  ffi::Error first_ = ffi::Error::Success();
};

}  // namespace jaxoverlap

// A CUDA runtime call returning cudaError_t.
#define JAXOVERLAP_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                          \
    cudaError_t jaxoverlap_err_ = (expr);                                       \
    if (jaxoverlap_err_ != cudaSuccess) {                                       \
      return ::jaxoverlap::CudaError(jaxoverlap_err_, #expr, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

// After a kernel launch or a void on-stream NVSHMEM call.
#define JAXOVERLAP_RETURN_IF_LAUNCH_ERROR(what)                                 \
  do {                                                                          \
    cudaError_t jaxoverlap_err_ = cudaGetLastError();                           \
    if (jaxoverlap_err_ != cudaSuccess) {                                       \
      return ::jaxoverlap::CudaError(jaxoverlap_err_, what, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

// An NVSHMEM call returning an int status (0 on success).
#define JAXOVERLAP_NVSHMEM_RETURN_IF_ERROR(expr)                                \
  do {                                                                          \
    int jaxoverlap_status_ = (expr);                                            \
    if (jaxoverlap_status_ != 0) {                                              \
      return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInternal,                \
                               ::jaxoverlap::Where(__FILE__, __LINE__) + #expr + \
                                   " failed: NVSHMEM status " +                 \
                                   std::to_string(jaxoverlap_status_));         \
    }                                                                           \
  } while (0)

// Any expression producing an ffi::Error.
#define JAXOVERLAP_RETURN_IF_ERROR(expr)                                        \
  do {                                                                          \
    ::xla::ffi::Error jaxoverlap_e_ = (expr);                                   \
    if (jaxoverlap_e_.failure()) return jaxoverlap_e_;                          \
  } while (0)

#endif  // JAXOVERLAP_CHECK_H_
