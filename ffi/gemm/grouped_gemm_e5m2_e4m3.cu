// The grouped GEMM's E5M2 x E4M3 kernels (both output types); see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

JAXQUANT_GROUPED_GEMM_PAIR(, jaxquant::grouped_gemm_detail::e5m2,
                           jaxquant::grouped_gemm_detail::e4m3)
