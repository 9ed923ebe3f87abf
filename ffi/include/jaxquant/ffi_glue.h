// XLA FFI glue shared by every handler: the codes formats travel as in FFI attributes,
// input dtype dispatch, workspaces, and CUDA error reporting.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

#include "jaxquant/handlers.h"

namespace jaxquant {

namespace ffi = xla::ffi;

// jaxquant.kernels._config's FAMILY_CODES (the element codes are numerics.cuh's Element).
enum Family : int32_t { kFp8Tensor = 0, kFp8Block = 1, kMxfp8 = 2, kNvfp4 = 3 };

// Device memory a GEMM call may use: its workspace result buffer, which XLA allocates with
// the call and Python sizes with the library's *WorkspaceBytes query (handlers.h); empty
// for none. Carved pieces start on kWorkspaceAlignment (cuBLASLt's and CUTLASS's TMA
// descriptors' 256 bytes), which the buffer itself need not be.
constexpr size_t kWorkspaceAlignment = 256;

inline size_t align_up(size_t value) {
  return (value + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;

  // The rest of the buffer from `offset` bytes past its first aligned address.
  Workspace after(size_t offset) const {
    const size_t start =
        align_up(reinterpret_cast<uintptr_t>(data)) - reinterpret_cast<uintptr_t>(data) + offset;
    return {static_cast<char*>(data) + start, bytes > start ? bytes - start : 0};
  }
};

inline ffi::Error cuda_error(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

inline ffi::Error cuda_status(const char* what) { return cuda_error(what, cudaGetLastError()); }

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(message);
}

// The error a handler returns when its workspace is smaller than its plan needs (the
// Python-side size and the handler's plan disagree: a bug, reported with both sizes).
inline ffi::Error check_workspace(const char* what, const Workspace& workspace, size_t needed) {
  if (workspace.bytes >= needed) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": the workspace holds " +
                              std::to_string(workspace.bytes) + " bytes, the call needs " +
                              std::to_string(needed));
}

// Calls f(T{}) with T the C++ type of a bf16 / f16 / f32 buffer.
template <typename F>
ffi::Error dispatch_float(ffi::DataType dtype, F&& f) {
  switch (dtype) {
    case ffi::DataType::BF16:
      return f(__nv_bfloat16{});
    case ffi::DataType::F16:
      return f(__half{});
    case ffi::DataType::F32:
      return f(float{});
    default:
      return invalid("input dtype must be bfloat16, float16 or float32");
  }
}

// [rows, cols] of a rank-2 buffer (the Python side flattens leading dims).
inline bool matrix_dims(const ffi::AnyBuffer& x, int64_t& rows, int64_t& cols) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return false;
  rows = dims[0];
  cols = dims[1];
  return true;
}

// Typed pointer of the index-th remaining result.
template <typename T>
ffi::ErrorOr<T*> result_ptr(ffi::RemainingRets& rets, size_t index) {
  auto buf = rets.get<ffi::AnyBuffer>(index);
  if (!buf.has_value()) return ffi::Unexpected(buf.error());
  return reinterpret_cast<T*>((*buf)->untyped_data());
}

}  // namespace jaxquant
