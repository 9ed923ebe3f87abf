// Per-tensor FP8 GEMM through cuBLASLt: D = (sa * sb) * (A . B^T), A [M, K] and B [N, K]
// FP8 codes in their stored (K-major) layout, sa and sb their decode scales (device
// scalars), D [M, N] bf16 or fp32 rounded once from the fp32 sums.
//
// Why not XLA's dot on f8 operands: XLA hands cuBLASLt the scales but keeps an fp32
// result and converts it to bf16 in a separate pass (an 8192^2 output: 128 us of a
// 0.95 ms call on the H100, notes/gemm.md). Asking cuBLASLt for the bf16 output directly
// drops that pass; the scaled fp32 sums are rounded once, as in the reference.
//
// Row-major D[m, n] = sum_k A[m, k] B[n, k] is column-major D^T = B^T-op . A, the "TN"
// form cuBLASLt's FP8 GEMMs require: cuBLAS's first operand is our B (transposed), its
// second our A, its output column-major [n, m], i.e. our row-major D.
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "jaxquant/ffi_glue.h"

namespace jaxquant {
namespace {

// The most workspace an algorithm may ask for: NVIDIA's recommendation for Hopper, where
// split-K algorithms keep partial sums in it. Only what the chosen one needs is allocated.
constexpr uint64_t kMaxWorkspaceBytes = uint64_t{32} << 20;
// cuBLASLt wants a 256-byte aligned workspace; XLA's scratch allocator promises 16 bytes.
constexpr uint64_t kWorkspaceAlignment = 256;
// Algorithms the first call of a problem times, the rounds, and the runs per timing.
constexpr int kCandidates = 8;
// The strictest operand alignment cuBLASLt's preferences know (and their default).
constexpr uint32_t kMaxOperandAlignment = 256;
constexpr int kRounds = 3;
constexpr int kTimedRuns = 3;

ffi::Error lt_error(const char* what, cublasStatus_t status) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("fp8_tensor_gemm: ") + what + ": " +
                              cublasLtGetStatusString(status));
}

// Releases cuBLASLt objects at scope exit (every early return included).
template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtDeleter {
  void operator()(T object) const { Destroy(object); }
};
template <typename T, cublasStatus_t (*Destroy)(T)>
using LtObject = std::unique_ptr<std::remove_pointer_t<T>, LtDeleter<T, Destroy>>;
using Desc = LtObject<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = LtObject<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = LtObject<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

bool lt_type(ffi::DataType dtype, cudaDataType_t& out) {
  switch (dtype) {
    case ffi::DataType::F8E4M3FN: out = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: out = CUDA_R_8F_E5M2; return true;
    case ffi::DataType::BF16: out = CUDA_R_16BF; return true;
    case ffi::DataType::F32: out = CUDA_R_32F; return true;
    default: return false;
  }
}

// The largest power of two, up to kMaxOperandAlignment, that divides the buffer's address.
// XLA promises less than cuBLASLt's default 256 bytes for its buffers (16 for entry
// parameters), so the heuristic is told each pointer's real alignment: an algorithm
// chosen for 256-byte pointers may fail on others.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = kMaxOperandAlignment;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// What one problem runs with: the chosen algorithm and the workspace it needs.
struct Plan {
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;
};

// The process's cuBLASLt handles (one per device) and chosen algorithms (one per device
// and problem). A handle per call would cost cublasLtCreate and a cublasLtDestroy that
// waits for the device (measured: the 8192^3 GEMM 15 % slower, 16-row GEMMs 2x slower);
// the heuristic costs host time on every call too. This is the cache pattern of JAX's own
// FFI examples (examples/ffi, "counter"): filled once, read under a mutex, never emptied,
// as cuBLASLt's own per-process state lives as long. Handles are not destroyed at exit:
// the CUDA context may be gone by then.
class LtCache {
 public:
  // device, m, n, k, the types of A, B and D, and the alignments of A, B and D
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, uint32_t, uint32_t, uint32_t>;

  static LtCache& instance() {
    static LtCache* cache = new LtCache();  // never destroyed: see above
    return *cache;
  }

  ffi::ErrorOr<cublasLtHandle_t> handle(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = handles_.find(device);
    if (found != handles_.end()) return found->second;
    cublasLtHandle_t created;
    const cublasStatus_t status = cublasLtCreate(&created);
    if (status != CUBLAS_STATUS_SUCCESS) {
      return ffi::Unexpected(ffi::Error::Internal(std::string("fp8_tensor_gemm: creating the "
                                                              "cuBLASLt handle: ") +
                                                  cublasLtGetStatusString(status)));
    }
    handles_.emplace(device, created);
    return created;
  }

  bool find(const Key& key, Plan& plan) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found == plans_.end()) return false;
    plan = found->second;
    return true;
  }

  void insert(const Key& key, const Plan& plan) {
    std::lock_guard<std::mutex> lock(mutex_);
    plans_.emplace(key, plan);
  }

 private:
  std::mutex mutex_;
  std::map<int, cublasLtHandle_t> handles_;
  std::map<Key, Plan> plans_;
};

template <typename T>
ffi::Error set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  return lt_error("setting a matmul attribute",
                  cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

// Workspace from XLA's scratch allocator (freed after the call, in stream order), aligned
// up to what cuBLASLt wants; null when none is needed.
ffi::ErrorOr<void*> allocate_workspace(ffi::ScratchAllocator& scratch, size_t bytes) {
  if (bytes == 0) return static_cast<void*>(nullptr);
  auto memory = scratch.Allocate(bytes + kWorkspaceAlignment, 16);
  if (!memory.has_value()) {
    return ffi::Unexpected(ffi::Error::Internal("fp8_tensor_gemm: could not allocate " +
                                                std::to_string(bytes) + " bytes of workspace"));
  }
  const auto address = reinterpret_cast<uintptr_t>(*memory);
  return reinterpret_cast<void*>((address + kWorkspaceAlignment - 1) / kWorkspaceAlignment *
                                 kWorkspaceAlignment);
}

// The heuristic's candidates timed on the call's own buffers, once per process and problem
// (XLA autotunes its own cuBLASLt calls the same way, at compile time): its first choice
// is not always the fastest (8192^3 E4M3 on the H100: 0.81 ms, the next seven 0.86-1.10).
// The host waits for these runs, once; the call's real run follows with the winner.
template <typename Run>
ffi::ErrorOr<Plan> fastest_candidate(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                     const cublasLtMatmulHeuristicResult_t* candidates, int found,
                                     Run&& run) {
  Plan best{candidates[0].algo, candidates[0].workspaceSize};
  if (found == 1) return best;
  size_t most = 0;
  for (int i = 0; i < found; ++i) most = std::max(most, candidates[i].workspaceSize);
  auto workspace = allocate_workspace(scratch, most);
  if (workspace.has_error()) return ffi::Unexpected(workspace.error());
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess) return best;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return best;
  }
  // Every candidate runs once first (an algorithm that fails is dropped), then the
  // candidates are timed in turns, several rounds, each keeping its best time: the clocks
  // still ramp and drift during the first call, and timing one candidate after the other
  // would favour the later ones.
  bool usable[kCandidates];
  for (int i = 0; i < found; ++i) {
    usable[i] = run(Plan{candidates[i].algo, candidates[i].workspaceSize}, *workspace).success();
  }
  float best_ms[kCandidates];
  std::fill(best_ms, best_ms + kCandidates, -1.0f);
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < found; ++i) {
      if (!usable[i]) continue;
      const Plan plan{candidates[i].algo, candidates[i].workspaceSize};
      cudaEventRecord(start, stream);
      for (int rep = 0; rep < kTimedRuns; ++rep) run(plan, *workspace);
      cudaEventRecord(stop, stream);
      float ms;
      if (cudaEventSynchronize(stop) != cudaSuccess ||
          cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
        usable[i] = false;
        continue;
      }
      if (best_ms[i] < 0 || ms < best_ms[i]) best_ms[i] = ms;
    }
  }
  int fastest = -1;
  for (int i = 0; i < found; ++i) {
    if (usable[i] && (fastest < 0 || best_ms[i] < best_ms[fastest])) fastest = i;
  }
  if (fastest >= 0) best = Plan{candidates[fastest].algo, candidates[fastest].workspaceSize};
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

#define JAXQUANT_LT_TRY(expr)          \
  do {                                 \
    ffi::Error error_ = (expr);        \
    if (error_.failure()) return error_; \
  } while (0)

ffi::Error fp8_tensor_gemm(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                           ffi::AnyBuffer a,
                           ffi::AnyBuffer b, ffi::Buffer<ffi::F32> sa, ffi::Buffer<ffi::F32> sb,
                           ffi::Result<ffi::AnyBuffer> d) {
  int64_t m, k, n, kb;
  const auto dd = d->dimensions();
  if (!matrix_dims(a, m, k) || !matrix_dims(b, n, kb) || dd.size() != 2 || kb != k ||
      dd[0] != m || dd[1] != n || sa.element_count() != 1 || sb.element_count() != 1) {
    return invalid("fp8_tensor_gemm: expects A [M, K], B [N, K], two scalar scales and D [M, N]");
  }
  cudaDataType_t ta, tb, td;
  if (!lt_type(a.element_type(), ta) || !lt_type(b.element_type(), tb) ||
      ta == CUDA_R_16BF || ta == CUDA_R_32F || tb == CUDA_R_16BF || tb == CUDA_R_32F ||
      (ta == CUDA_R_8F_E5M2 && tb == CUDA_R_8F_E5M2)) {
    return invalid("fp8_tensor_gemm: operands must be an FP8 pair other than E5M2 x E5M2");
  }
  if (!lt_type(d->element_type(), td) || (td != CUDA_R_16BF && td != CUDA_R_32F)) {
    return invalid("fp8_tensor_gemm: the output dtype must be bfloat16 or float32");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();

  LtCache& cache = LtCache::instance();
  auto handle = cache.handle(device);
  if (handle.has_error()) return handle.error();
  cublasLtMatmulDesc_t raw_desc;
  JAXQUANT_LT_TRY(lt_error("creating the matmul descriptor",
                           cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)));
  Desc desc(raw_desc);
  const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  const float* b_scale = sb.typed_data();  // cuBLAS's first operand is our B
  const float* a_scale = sa.typed_data();
  JAXQUANT_LT_TRY(set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, transposed));
  JAXQUANT_LT_TRY(set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, plain));
  JAXQUANT_LT_TRY(set(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale));
  JAXQUANT_LT_TRY(set(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale));

  cublasLtMatrixLayout_t raw_lb, raw_la, raw_ld;
  JAXQUANT_LT_TRY(lt_error("creating B's layout", cublasLtMatrixLayoutCreate(&raw_lb, tb, k, n, k)));
  Layout lb(raw_lb);
  JAXQUANT_LT_TRY(lt_error("creating A's layout", cublasLtMatrixLayoutCreate(&raw_la, ta, k, m, k)));
  Layout la(raw_la);
  JAXQUANT_LT_TRY(lt_error("creating D's layout", cublasLtMatrixLayoutCreate(&raw_ld, td, n, m, n)));
  Layout ld(raw_ld);

  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](cublasLtHandle_t h, const Plan& p, void* workspace) {
    return lt_error("running the GEMM",
                    cublasLtMatmul(h, raw_desc, &alpha, b.untyped_data(), raw_lb, a.untyped_data(),
                                   raw_la, &beta, d->untyped_data(), raw_ld, d->untyped_data(),
                                   raw_ld, &p.algo, workspace, p.workspace_bytes, stream));
  };
  const uint32_t align_a = alignment_of(a.untyped_data()), align_b = alignment_of(b.untyped_data()),
                 align_d = alignment_of(d->untyped_data());
  const LtCache::Key key{device, m, n, k, ta, tb, td, align_a, align_b, align_d};
  Plan plan;
  if (!cache.find(key, plan)) {
    cublasLtMatmulPreference_t raw_pref;
    JAXQUANT_LT_TRY(lt_error("creating the preference", cublasLtMatmulPreferenceCreate(&raw_pref)));
    Preference pref(raw_pref);
    JAXQUANT_LT_TRY(lt_error("setting the workspace size",
                             cublasLtMatmulPreferenceSetAttribute(
                                 raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                 &kMaxWorkspaceBytes, sizeof(kMaxWorkspaceBytes))));
    // cuBLAS's A is our B and its B our A; C is D (beta = 0, same buffer).
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attribute, bytes] : alignments) {
      JAXQUANT_LT_TRY(lt_error("setting an operand alignment",
                               cublasLtMatmulPreferenceSetAttribute(raw_pref, attribute, &bytes,
                                                                    sizeof(bytes))));
    }
    cublasLtMatmulHeuristicResult_t candidates[kCandidates];
    int found = 0;
    JAXQUANT_LT_TRY(lt_error("querying the algorithm heuristic",
                             cublasLtMatmulAlgoGetHeuristic(*handle, raw_desc, raw_lb, raw_la, raw_ld,
                                                            raw_ld, raw_pref, kCandidates, candidates,
                                                            &found)));
    if (found == 0) {
      return ffi::Error::Internal("fp8_tensor_gemm: cuBLASLt has no algorithm for M=" +
                                  std::to_string(m) + ", N=" + std::to_string(n) +
                                  ", K=" + std::to_string(k));
    }
    auto fastest = fastest_candidate(stream, scratch, candidates, found, [&](const Plan& p, void* ws) {
      return run(*handle, p, ws);
    });
    if (fastest.has_error()) return fastest.error();
    plan = *fastest;
    cache.insert(key, plan);
  }
  auto workspace = allocate_workspace(scratch, plan.workspace_bytes);
  if (workspace.has_error()) return workspace.error();
  return run(*handle, plan, *workspace);
}

#undef JAXQUANT_LT_TRY

}  // namespace
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantFp8TensorGemm, jaxquant::fp8_tensor_gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>());
