// The grouped GEMM's E4M3 x E5M2 kernels (both output types); see grouped_gemm.cuh.
#include "grouped_gemm.cuh"

JAXQUANT_GROUPED_GEMM_PAIR(, jaxquant::grouped_gemm_detail::e4m3,
                           jaxquant::grouped_gemm_detail::e5m2)
