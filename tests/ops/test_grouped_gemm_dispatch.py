"""Which grouped GEMM `grouped_dense`'s operands go to: the kernel's input types per pair."""

import jax.numpy as jnp
import pytest

from jaxquant.ops._grouped_gemm import kernel_dtypes

E4M3, E5M2, BF16 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.bfloat16)


@pytest.mark.parametrize(
  "a,b,k,n,want",
  [
    (E4M3, E4M3, 64, 32, (E4M3, E4M3)),  # FP8 tensor cores
    (E4M3, E5M2, 64, 32, (E4M3, E5M2)),
    (E5M2, E5M2, 64, 32, (BF16, BF16)),  # no E5M2 x E5M2 MMA: FP8 codes are exact in bf16
    (E4M3, BF16, 64, 32, (BF16, BF16)),  # a mixed pair (hybrid recipes)
    (BF16, BF16, 64, 32, (BF16, BF16)),
    (E4M3, E4M3, 8, 32, (BF16, BF16)),  # K = 8 is too short a row for FP8 TMA, fine for bf16
    (BF16, BF16, 4, 32, None),  # ... and too short for bf16 too
    (BF16, BF16, 64, 6, None),  # N = 6: fp32 output rows not 16-byte aligned
    (None, BF16, 64, 32, None),  # values not exact in any narrow type
  ],
)
def test_kernel_dtypes(a, b, k, n, want):
  assert kernel_dtypes(a, b, k, n) == want
