// The grouped GEMMs' FFI handlers, one per grouping (rows: fprop and dgrad; contraction:
// wgrad): each checks the buffers and dispatches on the operand and output dtypes to the
// instantiations compiled in grouped_gemm_<pair>.cu (see grouped_gemm.cuh for the kernel).
#include <algorithm>

#include "grouped_gemm.cuh"
#include "jaxquant/bindings.h"

JAXQUANT_GROUPED_GEMM_PAIR(extern, jaxquant::grouped_gemm_detail::bf16,
                           jaxquant::grouped_gemm_detail::bf16)
JAXQUANT_GROUPED_GEMM_PAIR(extern, jaxquant::grouped_gemm_detail::e4m3,
                           jaxquant::grouped_gemm_detail::e4m3)
JAXQUANT_GROUPED_GEMM_PAIR(extern, jaxquant::grouped_gemm_detail::e4m3,
                           jaxquant::grouped_gemm_detail::e5m2)
JAXQUANT_GROUPED_GEMM_PAIR(extern, jaxquant::grouped_gemm_detail::e5m2,
                           jaxquant::grouped_gemm_detail::e4m3)

namespace jaxquant {
namespace grouped_gemm_detail {
namespace {

// Calls f(A{}, B{}, D{}) for the supported dtype triples.
template <typename F>
ffi::Error dispatch_grouped(ffi::DataType ta, ffi::DataType tb, ffi::DataType td, F&& f) {
  using ffi::DataType;
  auto with_out = [&](auto a, auto b) -> ffi::Error {
    if (td == DataType::BF16) return f(a, b, bf16{});
    if (td == DataType::F32) return f(a, b, float{});
    return invalid("grouped_gemm: the output dtype must be bfloat16 or float32");
  };
  if (ta == DataType::BF16 && tb == DataType::BF16) return with_out(bf16{}, bf16{});
  if (ta == DataType::F8E4M3FN && tb == DataType::F8E4M3FN) return with_out(e4m3{}, e4m3{});
  if (ta == DataType::F8E4M3FN && tb == DataType::F8E5M2) return with_out(e4m3{}, e5m2{});
  if (ta == DataType::F8E5M2 && tb == DataType::F8E4M3FN) return with_out(e5m2{}, e4m3{});
  return invalid(
      "grouped_gemm: operands must be bfloat16 x bfloat16 or an FP8 pair other "
      "than E5M2 x E5M2");
}

ffi::Error grouped_gemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                        ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> alpha,
                        ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace) {
  const auto da = a.dimensions(), db = b.dimensions(), dd = d->dimensions();
  if (da.size() != 2 || db.size() != 3 || dd.size() != 2) {
    return invalid("grouped_gemm: expects A [M, K], B [G, N, K] and D [M, N]");
  }
  const int64_t m = da[0], k = da[1], g = db[0], n = db[1];
  if (db[2] != k || dd[0] != m || dd[1] != n || sizes.element_count() != g ||
      alpha.element_count() != g) {
    return invalid("grouped_gemm: operand shapes disagree");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  return dispatch_grouped(
      a.element_type(), b.element_type(), d->element_type(), [&](auto ea, auto eb, auto ed) {
        return run_grouped<decltype(ea), decltype(eb), decltype(ed)>(
            stream, Workspace{workspace->untyped_data(), workspace->size_bytes()}, a.untyped_data(),
            b.untyped_data(), sizes.typed_data(), alpha.typed_data(), d->untyped_data(),
            static_cast<int32_t>(g), static_cast<int32_t>(m), static_cast<int32_t>(n),
            static_cast<int32_t>(k), /*contraction_grouping=*/false);
      });
}

// D[g] = alpha[g] * A[:, cols of g] . B[:, cols of g]^T, A [P, L], B [Q, L], D [G, P, Q].
ffi::Error grouped_wgrad(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> alpha,
                         ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace) {
  const auto da = a.dimensions(), db = b.dimensions(), dd = d->dimensions();
  if (da.size() != 2 || db.size() != 2 || dd.size() != 3) {
    return invalid("grouped_wgrad: expects A [P, L], B [Q, L] and D [G, P, Q]");
  }
  const int64_t p = da[0], l = da[1], q = db[0], g = dd[0];
  if (db[1] != l || dd[1] != p || dd[2] != q || sizes.element_count() != g ||
      alpha.element_count() != g) {
    return invalid("grouped_wgrad: operand shapes disagree");
  }
  // TMA reads A and B with a row pitch of L elements and each group from a column that is
  // a multiple of kColumnAlign: both must fall on 16 bytes.
  if (l % kColumnAlign != 0) {
    return invalid("grouped_wgrad: L (the columns of A and B) must be a multiple of 16");
  }
  if (g == 0 || p == 0 || q == 0) return ffi::Error::Success();
  if (l > INT32_MAX || p > INT32_MAX || q > INT32_MAX) {
    return invalid("grouped_wgrad: dims must fit in int32");
  }
  return dispatch_grouped(
      a.element_type(), b.element_type(), d->element_type(), [&](auto ea, auto eb, auto ed) {
        return run_grouped<decltype(ea), decltype(eb), decltype(ed)>(
            stream, Workspace{workspace->untyped_data(), workspace->size_bytes()}, a.untyped_data(),
            b.untyped_data(), sizes.typed_data(), alpha.typed_data(), d->untyped_data(),
            static_cast<int32_t>(g), static_cast<int32_t>(l), static_cast<int32_t>(p),
            static_cast<int32_t>(q), /*contraction_grouping=*/true);
      });
}

// The largest workspace any instantiation needs for num_groups groups on this device.
int64_t largest_workspace_bytes(int32_t num_groups) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  size_t most = 0;
  auto take = [&](auto ea, auto eb) {
    using TA = decltype(ea);
    using TB = decltype(eb);
    most = std::max({most, workspace_bytes<TA, TB, bf16>(num_groups, device),
                     workspace_bytes<TA, TB, float>(num_groups, device)});
  };
  take(bf16{}, bf16{});
  take(e4m3{}, e4m3{});
  take(e4m3{}, e5m2{});
  take(e5m2{}, e4m3{});
  return static_cast<int64_t>(most);
}

}  // namespace
}  // namespace grouped_gemm_detail
}  // namespace jaxquant

int64_t JaxquantGroupedGemmWorkspaceBytes(int32_t num_groups) {
  if (num_groups < 0) return -1;
  return jaxquant::grouped_gemm_detail::largest_workspace_bytes(num_groups);
}

// The same kernels, so the same workspace.
int64_t JaxquantGroupedWgradWorkspaceBytes(int32_t num_groups) {
  return JaxquantGroupedGemmWorkspaceBytes(num_groups);
}

JAXQUANT_DEFINE_HANDLER(JaxquantGroupedGemm, jaxquant::grouped_gemm_detail::grouped_gemm,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()              // A
                            .Arg<xla::ffi::AnyBuffer>()              // B
                            .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group sizes
                            .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // alpha per group
                            .Ret<xla::ffi::AnyBuffer>()              // D
                            .Ret<xla::ffi::AnyBuffer>());            // workspace

JAXQUANT_DEFINE_HANDLER(JaxquantGroupedWgrad, jaxquant::grouped_gemm_detail::grouped_wgrad,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()              // A [P, L]
                            .Arg<xla::ffi::AnyBuffer>()              // B [Q, L]
                            .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group sizes
                            .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // alpha per group
                            .Ret<xla::ffi::AnyBuffer>()              // D [G, P, Q]
                            .Ret<xla::ffi::AnyBuffer>());            // workspace
