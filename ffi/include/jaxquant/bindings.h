// FFI signatures that several handlers share, written once: the Python side calls these
// handlers with the same operands and attributes, so their bindings must not drift apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "jaxquant/ffi_glue.h"

namespace jaxquant {

// Every cast family (fp8_tensor, fp8_block, mxfp8, nvfp4) is one primitive on the Python
// side (kernels/cast.py), which picks the target by family and passes the same operands:
// x [M, K], the rowwise and columnwise global amaxes (the per-tensor FP8 amax or delayed
// scale, NVFP4's global amaxes), the stochastic-rounding seed (uint32[2], else an unread
// scalar), and KernelConfig as attributes. A family ignores the operands it does not use.
// The results are (data, scale) per requested usage (take_cast_results).
inline auto cast_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // row amax
      .Arg<ffi::AnyBuffer>()  // col amax
      .Arg<ffi::AnyBuffer>()  // seed
      .RemainingRets()
      .Attrs<KernelConfig>();
}

// Points out's row_data / row_scale and col_data / col_scale at a cast's results: for each
// usage cfg asks for, rowwise first, its codes then its scales (kernels/cast.py's
// _abstract_eval). Usages not asked for stay null. `Out` is the family's result struct.
// The observed amax (cfg.observe_amax, per-tensor FP8 only) follows them: the family takes it.
template <typename Out>
ffi::Error take_cast_results(ffi::RemainingRets& rets, const KernelConfig& cfg, const char* what,
                             Out& out) {
  using Scale = std::remove_pointer_t<decltype(out.row_scale)>;
  if (cfg.observe_amax && cfg.family != kFp8Tensor) {
    return invalid(std::string(what) + ": only the per-tensor FP8 cast observes the amax");
  }
  size_t next = 0;
  auto take = [&](const char* usage, uint8_t*& data, Scale*& scale) {
    auto d = result_ptr<uint8_t>(rets, next++);
    auto s = result_ptr<Scale>(rets, next++);
    if (!d.has_value() || !s.has_value()) {
      return invalid(std::string(what) + ": missing " + usage + " results");
    }
    data = *d;
    scale = *s;
    return ffi::Error::Success();
  };
  if (cfg.rowwise) {
    if (auto err = take("rowwise", out.row_data, out.row_scale); err.failure()) return err;
  }
  if (cfg.columnwise) {
    if (auto err = take("columnwise", out.col_data, out.col_scale); err.failure()) return err;
  }
  return ffi::Error::Success();
}

// The scaled FP8 GEMMs D = A . B^T (fp8_tensor_gemm, block_fp8_gemm) take the same
// operands from Python (kernels/tensor_gemm.py, kernels/block_gemm.py): A [M, K] and
// B [N, K] codes, A's and B's float32 decode scales (scalars per tensor, MN-major blocks
// otherwise), and D; each handler appends what only it has (a workspace, attributes).
inline auto scaled_gemm_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()         // A
      .Arg<ffi::AnyBuffer>()         // B
      .Arg<ffi::Buffer<ffi::F32>>()  // A's scales
      .Arg<ffi::Buffer<ffi::F32>>()  // B's scales
      .Ret<ffi::AnyBuffer>();        // D
}

}  // namespace jaxquant
