// Grouped GEMMs for grouped_dense (MoE experts), group sizes read on the device. Two
// groupings of one kernel:
//
//   rows (fprop, dgrad):  D[rows of g] = alpha[g] * A[rows of g] . B[g]^T
//                         A [M, K], B [G, N, K], D [M, N]
//   contraction (wgrad):  D[g] = alpha[g] * A[:, cols of g] . B[:, cols of g]^T
//                         A [P, L], B [Q, L], D [G, P, Q]
//
// Rows: contiguous per group (group g owns the sizes[g] rows after those of groups < g;
// sizes are clipped at M like reference.grouped.group_layout); rows past the last group
// are written as zeros. Contraction: group g owns sizes[g] columns of A and B from column
// S_g = the sum over h < g of sizes[h] rounded up to kColumnAlign, the layout whose every
// group starts on a 16-byte boundary for TMA (columns past a group's size, up to the next
// start, are never read; groups are clipped at L); an empty group's D[g] is zeros. This is
// the wgrad of each expert, its K the expert's rows: the "K-grouped" problem list.
// One CUTLASS Hopper pointer-array kernel (TMA, warp-specialized, persistent) runs every
// group: a setup kernel turns the sizes into the per-group problem shapes and pointers in
// the call's workspace, so nothing waits on the host and the call is the same work under
// a CUDA graph. The workspace is a result buffer that XLA allocates
// with the call (`workspace_bytes` says how large), not scratch memory, so XLA may capture
// the call into its command buffers.
//
// Operands: bf16 x bf16 (the exact-in-bf16 emulation of MXFP8 / NVFP4 / block FP8 and
// unquantized bf16), and per-tensor FP8 with any E4M3/E5M2 pair on FP8 tensor cores.
// Accumulation is fp32. bf16 results are the reference's up to fp32 summation order. FP8
// partial sums are promoted to fp32 every four k-blocks (no fast accumulation), but the
// FP8 MMA adds each instruction's products with about 14 bits of alignment, so FP8 results
// are within about 1e-4 (relative, normwise) of the reference: docs/numerics.md.
//
// This header holds the kernel templates; grouped_gemm.cu the FFI handlers, and each
// grouped_gemm_<pair>.cu compiles the instantiations of one operand pair, so that the
// CUTLASS kernels build in parallel.
#pragma once

#include <cutlass/cutlass.h>

#include <algorithm>

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/float8.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "jaxquant/ffi_glue.h"

namespace jaxquant {
namespace grouped_gemm_detail {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

// One kernel type per (A, B, D) element triple. FP8 keeps a second fp32 accumulator for
// the promotion, so its tile is half as wide (a 128x256 one spills registers).
template <typename TA, typename TB, typename TD>
struct GroupedGemm {
  static constexpr bool kFp8 = sizeof(TA) == 1;
  using TileShape = std::conditional_t<kFp8, Shape<_128, _128, _128>, Shape<_128, _256, _64>>;
  // No clusters: a 2x1 cluster gives a CTA pair two M tiles of one group, so a group with
  // an odd number of M tiles leaves one CTA of the pair idle for a step. On the H100 1x1
  // gains 3-6 % on router-like (Dirichlet) group sizes and loses nothing on equal ones
  // (docs/kernels.md).
  using ClusterShape = Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<TD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor*, kAlignD,  // no C operand: D = alpha * acc
      TD, cutlass::layout::RowMajor*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<TD, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TA, cutlass::layout::RowMajor*,
      16 / sizeof(TA),                                     // A [M, K], K contiguous
      TB, cutlass::layout::ColumnMajor*, 16 / sizeof(TB),  // B[g] [N, K], K contiguous
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arrays the kernel reads, carved from the front of the workspace.
  struct Groups {
    GroupShape* shapes;
    const TA** a;
    const TB** b;
    TD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    int32_t* rows_used;  // sum of the clipped sizes
  };

  static size_t groups_bytes(int64_t g) {
    return g * (sizeof(GroupShape) + sizeof(void*) * 3 + sizeof(StrideA) + sizeof(StrideB) +
                sizeof(StrideD)) +
           16 * 8;  // slack for aligning each array
  }

  static Groups carve(void* base, int64_t g) {
    auto bump = [p = reinterpret_cast<uintptr_t>(base)](size_t bytes) mutable {
      p = (p + 15) & ~uintptr_t{15};
      void* out = reinterpret_cast<void*>(p);
      p += bytes;
      return out;
    };
    Groups out;
    out.shapes = static_cast<GroupShape*>(bump(g * sizeof(GroupShape)));
    out.a = static_cast<const TA**>(bump(g * sizeof(void*)));
    out.b = static_cast<const TB**>(bump(g * sizeof(void*)));
    out.d = static_cast<TD**>(bump(g * sizeof(void*)));
    out.stride_a = static_cast<StrideA*>(bump(g * sizeof(StrideA)));
    out.stride_b = static_cast<StrideB*>(bump(g * sizeof(StrideB)));
    out.stride_d = static_cast<StrideD*>(bump(g * sizeof(StrideD)));
    out.rows_used = static_cast<int32_t*>(bump(sizeof(int32_t)));
    return out;
  }
};

// What the group sizes divide: the rows of A and D, or the contraction's columns of A and B.
enum class Grouping { kRows, kContraction };

// In the contraction grouping each group starts on a multiple of this many columns (16
// bytes of FP8; 32 of bf16, which keeps one layout for both).
constexpr int64_t kColumnAlign = 16;

// One CTA: group g starts at min(P_g, m), P_g the sum of the (non-negative) sizes before it
// (each rounded up to kColumnAlign in the contraction grouping), so a group is clipped
// where the sizes pass m (the rows, or the columns L) and later ones are empty. The prefix
// sums are a block scan over chunks of kSetupThreads groups (one thread walking 64 groups
// took 6 us, 2 % of the G=64 benchmark's GEMM).
constexpr int kSetupThreads = 256;

template <typename Config, Grouping kGrouping, typename TA, typename TB, typename TD>
__global__ __launch_bounds__(kSetupThreads) void setup_groups(const int32_t* __restrict__ sizes,
                                                              int32_t num_groups, int32_t m,
                                                              int32_t n, int32_t k, const TA* a,
                                                              const TB* b, TD* d,
                                                              typename Config::Groups groups) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t carry;  // sizes of the chunks before this one
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int32_t base = 0; base < num_groups; base += kSetupThreads) {
    const int32_t g = base + threadIdx.x;
    const int64_t size = g < num_groups ? max(sizes[g], 0) : 0;
    const int64_t span = kGrouping == Grouping::kRows
                             ? size
                             : (size + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
    int64_t before, chunk;
    Scan(scan).ExclusiveSum(span, before, chunk);
    before += carry;
    if (g < num_groups) {
      const int32_t start = static_cast<int32_t>(min(before, int64_t{m}));
      const int32_t used = static_cast<int32_t>(min(before + size, int64_t{m})) - start;
      using cutlass::make_cute_packed_stride;
      if constexpr (kGrouping == Grouping::kRows) {
        groups.shapes[g] = GroupShape(used, n, k);
        groups.a[g] = a + static_cast<int64_t>(start) * k;
        groups.b[g] = b + static_cast<int64_t>(g) * n * k;
        groups.d[g] = d + static_cast<int64_t>(start) * n;
        groups.stride_a[g] = make_cute_packed_stride(typename Config::StrideA{}, {used, k, 1});
        groups.stride_b[g] = make_cute_packed_stride(typename Config::StrideB{}, {n, k, 1});
        groups.stride_d[g] = make_cute_packed_stride(typename Config::StrideD{}, {used, n, 1});
      } else {
        // Here n is P (A's rows), k is Q (B's rows) and m is L (the columns); D[g] is [P, Q].
        // An empty group gets no tile (P = 0): zero_empty_groups writes its D[g].
        groups.shapes[g] = GroupShape(used > 0 ? n : 0, k, used);
        groups.a[g] = a + start;
        groups.b[g] = b + start;
        groups.d[g] = d + static_cast<int64_t>(g) * n * k;
        groups.stride_a[g] = make_cute_packed_stride(typename Config::StrideA{}, {n, m, 1});
        groups.stride_b[g] = make_cute_packed_stride(typename Config::StrideB{}, {k, m, 1});
        groups.stride_d[g] = make_cute_packed_stride(typename Config::StrideD{}, {n, k, 1});
      }
    }
    __syncthreads();  // every thread has read carry (and the scan storage is free again)
    if (threadIdx.x == 0) carry += chunk;
    __syncthreads();
  }
  if (threadIdx.x == 0) *groups.rows_used = static_cast<int32_t>(min(carry, int64_t{m}));
}

// Rows at or past rows_used belong to no group: zeros, as in the reference.
template <typename TD>
__global__ void zero_unused_rows(TD* d, const int32_t* rows_used, int64_t m, int64_t n) {
  const int64_t first = static_cast<int64_t>(*rows_used) * n;
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < m * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    d[i] = TD(0.0f);
  }
}

// The contraction grouping's empty groups (no tile was scheduled for them): D[g] = 0.
template <typename TD>
__global__ void zero_empty_groups(TD* d, const GroupShape* shapes, int64_t group_elements) {
  const int64_t g = blockIdx.y;
  if (cute::get<0>(shapes[g]) != 0) return;
  TD* out = d + g * group_elements;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < group_elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = TD(0.0f);
  }
}

// The CUTLASS arguments known before the group shapes: the group count, the SM count
// (the persistent kernel keeps one set of TMA descriptors per SM in its workspace) and alpha.
template <typename Gemm>
typename Gemm::Arguments host_arguments(int32_t num_groups, int32_t device, const float* alpha) {
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  // The group count is known; the shapes are not, so none are given on the host.
  args.problem_shape = {num_groups, nullptr, nullptr};
  auto& fusion = args.epilogue.thread;
  fusion.alpha_ptr = alpha;  // alpha[g]: the group index is the batch coordinate
  fusion.dAlpha = {_0{}, _0{}, 1};
  fusion.beta = 0.0f;
  return args;
}

// Bytes of workspace one call needs: the per-group arrays, then CUTLASS's workspace, each
// from an aligned start (CUTLASS keeps TMA descriptors in its part).
template <typename TA, typename TB, typename TD>
size_t workspace_bytes(int32_t num_groups, int32_t device) {
  using Config = GroupedGemm<TA, TB, TD>;
  const auto args = host_arguments<typename Config::Gemm>(num_groups, device, nullptr);
  return kWorkspaceAlignment + align_up(Config::groups_bytes(num_groups)) +
         Config::Gemm::get_workspace_size(args);
}

// Rows: m, n, k are the GEMM's M, N, K. Contraction: m is L, n is P, k is Q (setup_groups).
template <typename TA, typename TB, typename TD>
ffi::Error run_grouped(cudaStream_t stream, const Workspace& workspace, const void* a,
                       const void* b, const int32_t* sizes, const float* alpha, void* d,
                       int32_t num_groups, int32_t m, int32_t n, int32_t k,
                       bool contraction_grouping) {
  using Config = GroupedGemm<TA, TB, TD>;
  using Gemm = typename Config::Gemm;
  int device = 0;
  if (auto err = cuda_error("cudaGetDevice", cudaGetDevice(&device)); err.failure()) return err;
  auto args = host_arguments<Gemm>(num_groups, device, alpha);
  const size_t needed = workspace_bytes<TA, TB, TD>(num_groups, device);
  if (auto err = check_workspace("grouped_gemm", workspace, needed); err.failure()) return err;
  const auto groups = Config::carve(workspace.after(0).data, num_groups);
  void* cutlass_workspace = workspace.after(align_up(Config::groups_bytes(num_groups))).data;
  auto setup = contraction_grouping ? setup_groups<Config, Grouping::kContraction, TA, TB, TD>
                                    : setup_groups<Config, Grouping::kRows, TA, TB, TD>;
  setup<<<1, kSetupThreads, 0, stream>>>(sizes, num_groups, m, n, k, static_cast<const TA*>(a),
                                         static_cast<const TB*>(b), static_cast<TD*>(d), groups);
  if (auto err = cuda_status("grouped_gemm setup"); err.failure()) return err;

  args.problem_shape = {num_groups, groups.shapes, nullptr};
  args.mainloop = {groups.a, groups.stride_a, groups.b, groups.stride_b};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = groups.d;
  args.epilogue.dD = groups.stride_d;

  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return invalid(
        "grouped_gemm: CUTLASS cannot run this problem (the contiguous dims must be "
        "multiples of 16 bytes' worth of elements)");
  }
  if (gemm.initialize(args, cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    return ffi::Error::Internal("grouped_gemm: CUTLASS initialization failed");
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    return cuda_status("grouped_gemm: CUTLASS kernel launch");
  }
  if (contraction_grouping) {
    const int64_t group_elements = static_cast<int64_t>(n) * k;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((group_elements + 255) / 256, 64)),
                    static_cast<unsigned>(num_groups));
    zero_empty_groups<<<grid, 256, 0, stream>>>(static_cast<TD*>(d), groups.shapes, group_elements);
    return cuda_status("grouped_gemm zero empty groups");
  }
  zero_unused_rows<<<264, 256, 0, stream>>>(static_cast<TD*>(d), groups.rows_used, m, n);
  return cuda_status("grouped_gemm zero rows");
}

using bf16 = cutlass::bfloat16_t;
using e4m3 = cutlass::float_e4m3_t;
using e5m2 = cutlass::float_e5m2_t;

}  // namespace grouped_gemm_detail
}  // namespace jaxquant

// Declares (PREFIX = extern) or defines (PREFIX empty) run_grouped and workspace_bytes for
// one (A, B) pair and both output types.
#define JAXQUANT_GROUPED_GEMM_ARGS                                                    \
  cudaStream_t, const jaxquant::Workspace&, const void*, const void*, const int32_t*, \
      const float*, void*, int32_t, int32_t, int32_t, int32_t, bool
#define JAXQUANT_GROUPED_GEMM_OUT(PREFIX, TA, TB, TD)                                        \
  PREFIX template xla::ffi::Error jaxquant::grouped_gemm_detail::run_grouped<TA, TB, TD>(    \
      JAXQUANT_GROUPED_GEMM_ARGS);                                                           \
  PREFIX template size_t jaxquant::grouped_gemm_detail::workspace_bytes<TA, TB, TD>(int32_t, \
                                                                                    int32_t);
#define JAXQUANT_GROUPED_GEMM_PAIR(PREFIX, TA, TB)               \
  JAXQUANT_GROUPED_GEMM_OUT(PREFIX, TA, TB, cutlass::bfloat16_t) \
  JAXQUANT_GROUPED_GEMM_OUT(PREFIX, TA, TB, float)
