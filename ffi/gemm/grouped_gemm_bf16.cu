// The grouped GEMM's BF16 x BF16 kernels (both output types); see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

JAXQUANT_GROUPED_GEMM_PAIR(, jaxquant::grouped_gemm_detail::bf16,
                           jaxquant::grouped_gemm_detail::bf16)
