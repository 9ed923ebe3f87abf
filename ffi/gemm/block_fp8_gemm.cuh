// Block-scaled FP8 GEMM (DeepSeek-style block FP8), D = A . B^T with per-block decode scales:
//
//   D[m, n] = sum_kb  sa[kb, m] * sb[kb, n / b_block_rows] * sum_{k in kb} A[m, k] * B[n, k]
//
// A [M, K] E4M3 in 1x128 blocks (one scale per row and 128 k), B [N, K] E4M3 in 128x128
// tiles (fprop, dgrad) or 1x128 blocks (wgrad); D [M, N] bfloat16 or float32. The scales
// arrive MN-major ([K / 128, M] and [K / 128, N / b_block_rows]), the layout CUTLASS's
// Hopper blockwise mainloop reads: each 128-deep k-tile is summed on FP8 tensor cores,
// then scaled and added into the fp32 accumulator.
//
// This header holds the kernel template; block_fp8_gemm.cu the FFI handler, and
// block_fp8_gemm_tiles.cu / block_fp8_gemm_rows.cu compile the instantiations for B in
// 128x128 tiles / 1x128 blocks, so that the CUTLASS kernels build in parallel.
#pragma once

#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/float8.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "jaxquant/ffi_glue.h"

namespace jaxquant {
namespace block_fp8_gemm_detail {

using namespace cute;

constexpr int kBlock = 128;

template <int BlockRowsB, typename TD>
struct BlockFp8Gemm {
  using E4M3 = cutlass::float_e4m3_t;
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, BlockRowsB, kBlock>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<TD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignD,  // no C operand
      TD, cutlass::layout::RowMajor, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<TD, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E4M3,
      cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16,           // A [M, K]
      E4M3, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16,  // B [N, K]
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <int BlockRowsB, typename TD>
typename BlockFp8Gemm<BlockRowsB, TD>::Gemm::Arguments arguments(const void* a, const void* b,
                                                                 const float* sfa, const float* sfb,
                                                                 void* d, int m, int n, int k,
                                                                 int device) {
  using Config = BlockFp8Gemm<BlockRowsB, TD>;
  using Kernel = typename Config::Kernel;
  const auto problem = make_shape(m, n, k, 1);
  typename Config::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const typename Config::E4M3*>(a),
       cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1}),
       static_cast<const typename Config::E4M3*>(b),
       cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1}), sfa,
       Config::ScaleConfig::tile_atom_to_shape_SFA(problem), sfb,
       Config::ScaleConfig::tile_atom_to_shape_SFB(problem)},
      {{},
       nullptr,
       {},
       static_cast<TD*>(d),
       cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1})}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return args;
}

// Bytes of workspace the CUTLASS kernel needs for this problem on `device`.
template <int BlockRowsB, typename TD>
size_t cutlass_workspace_bytes(int m, int n, int k, int device) {
  return BlockFp8Gemm<BlockRowsB, TD>::Gemm::get_workspace_size(
      arguments<BlockRowsB, TD>(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, device));
}

template <int BlockRowsB, typename TD>
ffi::Error run_block_fp8(cudaStream_t stream, const Workspace& workspace, const void* a,
                         const void* b, const float* sfa, const float* sfb, void* d, int m, int n,
                         int k) {
  using Gemm = typename BlockFp8Gemm<BlockRowsB, TD>::Gemm;
  int device = 0;
  if (auto err = cuda_error("cudaGetDevice", cudaGetDevice(&device)); err.failure()) return err;
  const auto args = arguments<BlockRowsB, TD>(a, b, sfa, sfb, d, m, n, k, device);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return invalid(
        "block_fp8_gemm: CUTLASS cannot run this problem (K must be a multiple of "
        "16 and N of 16 bytes' worth of output elements)");
  }
  const auto err =
      check_workspace("block_fp8_gemm (CUTLASS)", workspace, Gemm::get_workspace_size(args));
  if (err.failure()) return err;
  if (gemm.initialize(args, workspace.data, stream) != cutlass::Status::kSuccess) {
    return ffi::Error::Internal("block_fp8_gemm: CUTLASS initialization failed");
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    return cuda_status("block_fp8_gemm: CUTLASS kernel launch");
  }
  return cuda_status("block_fp8_gemm");
}

}  // namespace block_fp8_gemm_detail
}  // namespace jaxquant

// Declares (PREFIX = extern) or defines (PREFIX empty) run_block_fp8 and
// cutlass_workspace_bytes for one B block shape and both output types.
#define JAXQUANT_BLOCK_FP8_GEMM_ARGS                                                              \
  cudaStream_t, const jaxquant::Workspace&, const void*, const void*, const float*, const float*, \
      void*, int, int, int
#define JAXQUANT_BLOCK_FP8_GEMM_OUT(PREFIX, BLOCK_ROWS_B, TD)           \
  PREFIX template xla::ffi::Error                                       \
      jaxquant::block_fp8_gemm_detail::run_block_fp8<BLOCK_ROWS_B, TD>( \
          JAXQUANT_BLOCK_FP8_GEMM_ARGS);                                \
  PREFIX template size_t                                                \
  jaxquant::block_fp8_gemm_detail::cutlass_workspace_bytes<BLOCK_ROWS_B, TD>(int, int, int, int);
#define JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(PREFIX, BLOCK_ROWS_B)          \
  JAXQUANT_BLOCK_FP8_GEMM_OUT(PREFIX, BLOCK_ROWS_B, cutlass::bfloat16_t) \
  JAXQUANT_BLOCK_FP8_GEMM_OUT(PREFIX, BLOCK_ROWS_B, float)
