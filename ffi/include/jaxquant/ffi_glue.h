// XLA FFI glue shared by every handler: the static config decoded from FFI attributes,
// input dtype dispatch, and CUDA error reporting.
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

// Mirror of jaxquant.kernels.config.KernelConfig: one frozen config, every field an FFI
// attribute of the same name. Values were validated in Python; handlers only re-check
// what would make a kernel touch memory out of bounds.
struct KernelConfig {
  int32_t family;      // 0 fp8_tensor, 1 fp8_block, 2 mxfp8, 3 nvfp4
  int32_t element;     // Element
  int32_t rowwise;     // produce the rowwise usage
  int32_t columnwise;  // produce the columnwise (transposed) usage
  int32_t block_rows;  // scaling block in the rowwise stored layout
  int32_t block_cols;
  int32_t pow2_scales;
  float eps;
  int32_t given_scale;  // FP8 per-tensor: the scalar input is the scale, not the amax
  int32_t rht;          // NVFP4: Hadamard transform on the columnwise usage
  int32_t stochastic_rounding;
  int32_t row_scaled;         // NVFP4 per-token: one global amax per rowwise row
  int32_t amax_per_row;       // amax kernel: per row instead of per tensor
  int32_t block_scales_only;  // dequantize: leave the outer scale (NVFP4 S_dec) out
  int32_t observe_amax;       // FP8 per-tensor cast: one more result, the input's amax
};

// Traits of every handler: for the same attributes and buffer shapes it launches the same
// kernels, never synchronizes with the host while XLA captures it, and takes no scratch
// memory (freed when the call returns, while a captured graph would keep the address): the
// GEMMs that need workspace take it as a result buffer that XLA allocates with the call.
// XLA may trace them into its command buffers (CUDA graphs) with the fusions around them.
#define JAXQUANT_CMD_BUFFER_SAFE {::xla::ffi::Traits::kCmdBufferCompatible}

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

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jaxquant::KernelConfig, ::xla::ffi::StructMember<int32_t>("family"),
    ::xla::ffi::StructMember<int32_t>("element"), ::xla::ffi::StructMember<int32_t>("rowwise"),
    ::xla::ffi::StructMember<int32_t>("columnwise"),
    ::xla::ffi::StructMember<int32_t>("block_rows"),
    ::xla::ffi::StructMember<int32_t>("block_cols"),
    ::xla::ffi::StructMember<int32_t>("pow2_scales"), ::xla::ffi::StructMember<float>("eps"),
    ::xla::ffi::StructMember<int32_t>("given_scale"), ::xla::ffi::StructMember<int32_t>("rht"),
    ::xla::ffi::StructMember<int32_t>("stochastic_rounding"),
    ::xla::ffi::StructMember<int32_t>("row_scaled"),
    ::xla::ffi::StructMember<int32_t>("amax_per_row"),
    ::xla::ffi::StructMember<int32_t>("block_scales_only"),
    ::xla::ffi::StructMember<int32_t>("observe_amax"));
