"""`fp32.widen` (bf16 / fp16 to fp32 from the bit patterns) bit for bit against the host's
conversions (numpy's float16, ml_dtypes' bfloat16) over every 16-bit pattern: zeros of both
signs, subnormals, normals, infinities and NaNs with their payloads."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxquant.reference import _fp32 as fp32


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
def test_widen_every_pattern(dtype):
  patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
  x = patterns.view(dtype)
  want = x.astype(np.float32).view(np.uint32)
  got = np.asarray(jax.jit(fp32.widen)(jnp.asarray(x))).view(np.uint32)
  mismatch = np.flatnonzero(got != want)
  assert mismatch.size == 0, [(hex(patterns[i]), hex(got[i]), hex(want[i])) for i in mismatch[:5]]


def test_widen_keeps_fp32_and_refuses_other_dtypes():
  x = jnp.float32([1.5, -0.0])
  assert fp32.widen(x) is x
  with pytest.raises(TypeError, match="int32"):
    fp32.widen(jnp.zeros((2,), jnp.int32))
