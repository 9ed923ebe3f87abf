// The block FP8 GEMM's FFI handler: checks the buffers and dispatches on B's block shape
// and the output dtype to the instantiations in block_fp8_gemm_tiles.cu and
// block_fp8_gemm_rows.cu (see block_fp8_gemm.cuh for the kernel).
#include "block_fp8_gemm.cuh"

JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(extern, 1)
JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(extern, 128)

namespace jaxquant {
namespace block_fp8_gemm_detail {
namespace {

ffi::Error block_fp8_gemm(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a,
                          ffi::AnyBuffer b, ffi::Buffer<ffi::F32> sfa, ffi::Buffer<ffi::F32> sfb,
                          ffi::Result<ffi::AnyBuffer> d, int32_t b_block_rows) {
  const auto da = a.dimensions(), db = b.dimensions(), dd = d->dimensions();
  if (da.size() != 2 || db.size() != 2 || dd.size() != 2) {
    return invalid("block_fp8_gemm: expects A [M, K], B [N, K] and D [M, N]");
  }
  const int64_t m = da[0], k = da[1], n = db[0];
  const int64_t kb = (k + kBlock - 1) / kBlock;
  const int64_t nb = b_block_rows == 1 ? n : (n + kBlock - 1) / kBlock;
  if (db[1] != k || dd[0] != m || dd[1] != n || sfa.element_count() != kb * m ||
      sfb.element_count() != kb * nb) {
    return invalid("block_fp8_gemm: operand shapes disagree");
  }
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN) {
    return invalid("block_fp8_gemm: operands must be float8_e4m3fn");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  auto launch = [&](auto out) -> ffi::Error {
    using TD = decltype(out);
    const auto args = std::make_tuple(stream, std::ref(scratch), a.untyped_data(), b.untyped_data(),
                                      sfa.typed_data(), sfb.typed_data(), d->untyped_data(),
                                      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
    if (b_block_rows == 1) return std::apply(run_block_fp8<1, TD>, args);
    if (b_block_rows == kBlock) return std::apply(run_block_fp8<kBlock, TD>, args);
    return invalid("block_fp8_gemm: B's blocks must be 1x128 or 128x128");
  };
  if (d->element_type() == ffi::DataType::BF16) return launch(cutlass::bfloat16_t{});
  if (d->element_type() == ffi::DataType::F32) return launch(float{});
  return invalid("block_fp8_gemm: the output dtype must be bfloat16 or float32");
}

}  // namespace
}  // namespace block_fp8_gemm_detail
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantBlockFp8Gemm, jaxquant::block_fp8_gemm_detail::block_fp8_gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("b_block_rows"));
