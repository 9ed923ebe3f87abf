// The block FP8 GEMM's kernels for B in 1x128 blocks (both output types); see block_fp8_gemm.cuh.
#include "block_fp8_gemm.cuh"

JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(, 1)
