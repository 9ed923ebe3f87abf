// The FFI bindings of the handlers, written once: what every handler shares (XLA's stream,
// the command-buffer trait), the signatures several handlers share, and the cast's config.
// The Python side calls these handlers with the same operands and attributes, so their
// bindings must not drift apart (tests/kernels/test_ffi_bindings.py compares each handler's
// attributes with its Python config's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "jaxquant/ffi_glue.h"

// Defines the exported handler `symbol` (handlers.h) of `impl` bound by `binding`. Every
// handler has the same traits: for the same attributes and buffer shapes it launches the
// same kernels, never synchronizes with the host while XLA captures it, and takes no
// scratch memory (freed when the call returns, while a captured graph would keep the
// address): the GEMMs that need workspace take it as a result buffer that XLA allocates
// with the call. XLA may trace them into its command buffers (CUDA graphs) with the fusions
// around them.
#define JAXQUANT_DEFINE_HANDLER(symbol, impl, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible})

namespace jaxquant {

// The start of every handler's binding: it runs on XLA's stream. A handler appends its
// operands, results and attributes.
inline auto stream_binding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

// Mirror of jaxquant.kernels._config.CastConfig, decoded from the FFI attributes of the same
// names (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING below). Values were validated in Python;
// handlers only re-check what would make a kernel touch memory out of bounds.
struct CastConfig {
  int32_t family;      // Family
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
  int32_t row_scaled;    // NVFP4 per-token: one global amax per rowwise row
  int32_t observe_amax;  // FP8 per-tensor: one more result, the input's amax
};

// Every cast family (fp8_tensor, fp8_block, mxfp8, nvfp4) is one primitive on the Python
// side (kernels/_cast.py), which picks the target by family and passes the same operands:
// x [M, K], the rowwise and columnwise global amaxes (the per-tensor FP8 amax or delayed
// scale, NVFP4's global amaxes), the stochastic-rounding seed (uint32[2], else an unread
// scalar), and CastConfig as attributes. A family ignores the operands it does not use.
// The results are (data, scale) per requested usage (take_cast_results).
inline auto cast_binding() {
  return stream_binding()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // row amax
      .Arg<ffi::AnyBuffer>()  // col amax
      .Arg<ffi::AnyBuffer>()  // seed
      .RemainingRets()
      .Attrs<CastConfig>();
}

// Points out's row_data / row_scale and col_data / col_scale at a cast's results: for each
// usage cfg asks for, rowwise first, its codes then its scales (kernels/_cast.py's
// _abstract_eval). Usages not asked for stay null. `Out` is the family's result struct.
// The observed amax (cfg.observe_amax, per-tensor FP8 only) follows them: the family takes it.
template <typename Out>
ffi::Error take_cast_results(ffi::RemainingRets& rets, const CastConfig& cfg, const char* what,
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
// operands from Python (kernels/_tensor_gemm.py, kernels/_block_gemm.py): A [M, K] and
// B [N, K] codes, A's and B's float32 decode scales (scalars per tensor, MN-major blocks
// otherwise), and D; each handler appends what only it has (a workspace, attributes).
inline auto scaled_gemm_binding() {
  return stream_binding()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()         // A
      .Arg<ffi::AnyBuffer>()         // B
      .Arg<ffi::Buffer<ffi::F32>>()  // A's scales
      .Arg<ffi::Buffer<ffi::F32>>()  // B's scales
      .Ret<ffi::AnyBuffer>();        // D
}

}  // namespace jaxquant

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jaxquant::CastConfig, ::xla::ffi::StructMember<int32_t>("family"),
    ::xla::ffi::StructMember<int32_t>("element"), ::xla::ffi::StructMember<int32_t>("rowwise"),
    ::xla::ffi::StructMember<int32_t>("columnwise"),
    ::xla::ffi::StructMember<int32_t>("block_rows"),
    ::xla::ffi::StructMember<int32_t>("block_cols"),
    ::xla::ffi::StructMember<int32_t>("pow2_scales"), ::xla::ffi::StructMember<float>("eps"),
    ::xla::ffi::StructMember<int32_t>("given_scale"), ::xla::ffi::StructMember<int32_t>("rht"),
    ::xla::ffi::StructMember<int32_t>("stochastic_rounding"),
    ::xla::ffi::StructMember<int32_t>("row_scaled"),
    ::xla::ffi::StructMember<int32_t>("observe_amax"));
