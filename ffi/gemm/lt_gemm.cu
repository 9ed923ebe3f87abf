// GEMMs through cuBLASLt (lt_gemm.h). Row-major D[m, n] = sum_k A[m, k] B[n, k] is
// column-major D^T = B^T-op . A, the "TN" form cuBLASLt's FP8 GEMMs require: cuBLAS's
// first operand is our B (transposed), its second our A, its output column-major [n, m],
// i.e. our row-major D.
#include "lt_gemm.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

namespace jaxquant {
namespace {

// Without workspace only algorithms that need none are candidates (H100, E4M3 per-tensor:
// the same tiles at 8192^3, 4096x16384x16384 and 16x8192x8192; only split-K candidates drop
// out, none of them the fastest), and cuBLASLt runs their statically scheduled kernels,
// which lose more beside NCCL's (fp8_tensor_gemm.cu): the GEMMs give it a workspace.
// Algorithms the first call of a problem times, the rounds, and the runs per timing.
constexpr int kCandidates = 8;
constexpr int kRounds = 3;
constexpr int kTimedRuns = 3;
// The strictest operand alignment cuBLASLt's preferences know (and their default).
constexpr uint32_t kMaxOperandAlignment = 256;

ffi::Error lt_error(const char* what, cublasStatus_t status) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("cuBLASLt GEMM: ") + what + ": " +
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
  // device, m, n, k, the types of A, B and D, the scale modes of A and B, the alignments of
  // A, B and D, the most workspace an algorithm may use, fast accumulation, and whether
  // alpha and beta come from the device
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, uint32_t,
                         uint32_t, uint32_t, uint64_t, bool, bool>;

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
      return ffi::Unexpected(ffi::Error::Internal(std::string("cuBLASLt GEMM: creating the "
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
ffi::Error set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
               const T& value) {
  return lt_error("setting a matmul attribute",
                  cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

// `bytes` of the workspace (aligned, as cuBLASLt wants it); null when none is needed.
ffi::ErrorOr<void*> workspace_for(const Workspace& workspace, size_t bytes) {
  if (bytes == 0) return static_cast<void*>(nullptr);
  if (bytes > workspace.bytes) {  // the preference's limit: cuBLASLt broke its promise
    return ffi::Unexpected(ffi::Error::Internal(
        "cuBLASLt GEMM: an algorithm asked for " + std::to_string(bytes) +
        " bytes of workspace, more than the " + std::to_string(workspace.bytes) + " given"));
  }
  return workspace.data;
}

// The heuristic's candidates timed on the call's own buffers, once per process and problem
// (XLA autotunes its own cuBLASLt calls the same way, at compile time): its first choice
// is not always the fastest (8192^3 E4M3 on the H100: 0.81 ms, the next seven 0.86-1.10).
// The host waits for these runs, once; the call's real run follows with the winner.
template <typename Run>
ffi::ErrorOr<Plan> fastest_candidate(cudaStream_t stream, const Workspace& workspace_given,
                                     const cublasLtMatmulHeuristicResult_t* candidates, int found,
                                     Run&& run) {
  Plan best{candidates[0].algo, candidates[0].workspaceSize};
  if (found == 1) return best;
  size_t most = 0;
  for (int i = 0; i < found; ++i) most = std::max(most, candidates[i].workspaceSize);
  auto workspace = workspace_for(workspace_given, most);
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

#define JAXQUANT_LT_UNEXPECTED(expr)                      \
  do {                                                    \
    ffi::Error error_ = (expr);                           \
    if (error_.failure()) return ffi::Unexpected(error_); \
  } while (0)

}  // namespace

ffi::ErrorOr<Workspace> lt_workspace_result(const ffi::RemainingRets& rets, const char* what) {
  if (rets.empty()) return Workspace{};
  auto buffer = rets.get<ffi::AnyBuffer>(0);
  if (rets.size() > 1 || !buffer.has_value()) {
    return ffi::Unexpected(invalid(std::string(what) + ": expects D and at most one workspace"));
  }
  const Workspace given{(*buffer)->untyped_data(), (*buffer)->size_bytes()};
  if (auto err = check_workspace(what, given, lt_workspace_result_bytes()); err.failure()) {
    return ffi::Unexpected(err);
  }
  return given;
}

ffi::ErrorOr<bool> lt_gemm(cudaStream_t stream, int32_t device, const Workspace& given,
                           const LtOperand& a, const LtOperand& b, const float* device_alpha_beta,
                           void* d, cudaDataType_t td, int64_t m, int64_t n, int64_t k,
                           bool fast_accumulation) {
  const Workspace workspace = given.after(0);
  LtCache& cache = LtCache::instance();
  auto handle = cache.handle(device);
  if (handle.has_error()) return ffi::Unexpected(handle.error());
  cublasLtMatmulDesc_t raw_desc;
  JAXQUANT_LT_UNEXPECTED(
      lt_error("creating the matmul descriptor",
               cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)));
  Desc desc(raw_desc);
  const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, transposed));
  JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, plain));
  // cuBLAS's first operand is our B. bf16 values take no operand scales (cuBLASLt refuses
  // them for non-FP8 types).
  if (b.scales.data != nullptr) {
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b.scales.data));
  }
  if (a.scales.data != nullptr) {
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a.scales.data));
  }
  if (device_alpha_beta != nullptr) {
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                               static_cast<int32_t>(CUBLASLT_POINTER_MODE_DEVICE)));
  }
  if (a.scales.mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
      b.scales.mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, b.scales.mode));
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, a.scales.mode));
  }
  if (fast_accumulation) {
    JAXQUANT_LT_UNEXPECTED(set(raw_desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{1}));
  }

  cublasLtMatrixLayout_t raw_lb, raw_la, raw_ld;
  JAXQUANT_LT_UNEXPECTED(
      lt_error("creating B's layout", cublasLtMatrixLayoutCreate(&raw_lb, b.type, k, n, k)));
  Layout lb(raw_lb);
  JAXQUANT_LT_UNEXPECTED(
      lt_error("creating A's layout", cublasLtMatrixLayoutCreate(&raw_la, a.type, k, m, k)));
  Layout la(raw_la);
  JAXQUANT_LT_UNEXPECTED(
      lt_error("creating D's layout", cublasLtMatrixLayoutCreate(&raw_ld, td, n, m, n)));
  Layout ld(raw_ld);

  const float host_alpha_beta[2] = {1.0f, 0.0f};
  const float* alpha_beta = device_alpha_beta != nullptr ? device_alpha_beta : host_alpha_beta;
  const float *alpha = alpha_beta, *beta = alpha_beta + 1;
  auto run = [&](cublasLtHandle_t h, const Plan& p, void* workspace) {
    return lt_error("running the GEMM", cublasLtMatmul(h, raw_desc, alpha, b.data, raw_lb, a.data,
                                                       raw_la, beta, d, raw_ld, d, raw_ld, &p.algo,
                                                       workspace, p.workspace_bytes, stream));
  };
  const uint32_t align_a = alignment_of(a.data), align_b = alignment_of(b.data),
                 align_d = alignment_of(d);
  // The limit is what the buffer holds past its first aligned address, capped at the size
  // that admits every algorithm: the cap keeps one plan per problem whatever the buffer's
  // address modulo 256 (the aligned start moves with it), so a call captured into a CUDA
  // graph finds the timed plan instead of taking the heuristic's first.
  const uint64_t max_workspace = std::min<uint64_t>(workspace.bytes, kLtWorkspaceBytes);
  const LtCache::Key key{device,
                         m,
                         n,
                         k,
                         a.type,
                         b.type,
                         td,
                         a.scales.mode,
                         b.scales.mode,
                         align_a,
                         align_b,
                         align_d,
                         max_workspace,
                         fast_accumulation,
                         device_alpha_beta != nullptr};
  Plan plan;
  if (!cache.find(key, plan)) {
    cublasLtMatmulPreference_t raw_pref;
    JAXQUANT_LT_UNEXPECTED(
        lt_error("creating the preference", cublasLtMatmulPreferenceCreate(&raw_pref)));
    Preference pref(raw_pref);
    JAXQUANT_LT_UNEXPECTED(lt_error(
        "setting the workspace size",
        cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &max_workspace, sizeof(max_workspace))));
    // cuBLAS's A is our B and its B our A; C is D (beta = 0, same buffer).
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attribute, bytes] : alignments) {
      JAXQUANT_LT_UNEXPECTED(lt_error(
          "setting an operand alignment",
          cublasLtMatmulPreferenceSetAttribute(raw_pref, attribute, &bytes, sizeof(bytes))));
    }
    cublasLtMatmulHeuristicResult_t candidates[kCandidates];
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(*handle, raw_desc, raw_lb, raw_la, raw_ld, raw_ld, raw_pref,
                                       kCandidates, candidates, &found);
    // NOT_SUPPORTED: no algorithm for this problem (shape, alignment or scale modes).
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
      return false;
    }
    JAXQUANT_LT_UNEXPECTED(lt_error("querying the algorithm heuristic", status));
    // While XLA captures the stream into a CUDA graph nothing may wait for the device, so
    // the heuristic's first choice runs untimed; it is kept like a timed plan. A call's
    // plan must not change once a graph holds it: XLA re-traces a captured call whenever
    // its buffers move and updates the graph in place, which fails if the new trace
    // launches other kernels (a split-K algorithm adds a reduction). The same problem
    // may also run directly from a part of the step XLA leaves out of its graphs, which
    // would otherwise time and keep another plan under the captured call's feet.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    JAXQUANT_LT_UNEXPECTED(cuda_error("cuBLASLt GEMM: querying stream capture",
                                      cudaStreamIsCapturing(stream, &capture)));
    if (capture != cudaStreamCaptureStatusNone) {
      plan = Plan{candidates[0].algo, candidates[0].workspaceSize};
    } else {
      auto fastest =
          fastest_candidate(stream, workspace, candidates, found,
                            [&](const Plan& p, void* ws) { return run(*handle, p, ws); });
      if (fastest.has_error()) return ffi::Unexpected(fastest.error());
      plan = *fastest;
    }
    cache.insert(key, plan);
  }
  auto plan_workspace = workspace_for(workspace, plan.workspace_bytes);
  if (plan_workspace.has_error()) return ffi::Unexpected(plan_workspace.error());
  JAXQUANT_LT_UNEXPECTED(run(*handle, plan, *plan_workspace));
  return true;
}

#undef JAXQUANT_LT_UNEXPECTED
}  // namespace jaxquant
