"""The one-byte transpose primitive: its reference lowering and partitioning against NumPy's
transpose, its input checks, and (on a GPU with the kernels) the kernel bit for bit
against NumPy's transpose on fresh random codes, every byte value (NUMERICS.md's NaN,
signed zero and largest codes among them), and shapes that are not whole tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxquant import kernels

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
DTYPES = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.uint8]
dtype_id = lambda d: np.dtype(d).name


def random_codes(seed: int, rows: int, cols: int, dtype) -> np.ndarray:
  """Uniform random bytes viewed as `dtype`: every code, NaN and signed zeros included."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (rows, cols), dtype=np.uint8).view(dtype)


def every_byte(rows: int, cols: int, dtype) -> np.ndarray:
  """The 256 byte values in order, repeated over the matrix."""
  return (np.arange(rows * cols) % 256).astype(np.uint8).reshape(rows, cols).view(dtype)


def assert_transposed(got, codes: np.ndarray) -> None:
  got = np.asarray(got)
  assert got.dtype == codes.dtype and got.shape == codes.shape[::-1]
  np.testing.assert_array_equal(got.view(np.uint8), codes.view(np.uint8).T)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_reference_lowering_is_the_transpose(dtype):
  codes = random_codes(0, 48, 32, dtype)
  assert_transposed(jax.jit(kernels.transpose_codes)(codes), codes)


@pytest.mark.parametrize(
  "shape, dtype, message",
  [
    ((32, 40), np.uint8, "R = 32 and C = 40 must be multiples of 16"),
    ((8, 32), np.uint8, "R = 8 and C = 32 must be multiples of 16"),
    ((32, 32), jnp.bfloat16, "one-byte codes, got bfloat16"),
    ((2, 16, 16), np.uint8, r"a \[R, C\] matrix, got shape \(2, 16, 16\)"),
  ],
)
def test_rejects_what_the_kernel_does_not_take(shape, dtype, message):
  with pytest.raises(ValueError, match=message):
    kernels.transpose_codes(jnp.zeros(shape, dtype))


@pytest.mark.parametrize(
  "spec", [P("a", None), P(None, "a"), P("a", "b"), P(("a", "b"), None)], ids=str
)
def test_each_device_transposes_its_shard(spec):
  devices = np.array(jax.devices()[:8])
  if devices.size < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = Mesh(devices.reshape(4, 2), ("a", "b"))
  codes = random_codes(1, 128, 64, ml_dtypes.float8_e4m3fn)
  placed = jax.device_put(codes, NamedSharding(mesh, spec))
  fn = jax.jit(kernels.transpose_codes)
  got = fn(placed)
  assert_transposed(got, codes)
  # The result is sharded as the input, its dims swapped: no collective moves the codes.
  assert got.sharding.spec == P(*tuple(spec)[::-1]) or got.sharding.is_equivalent_to(
    NamedSharding(mesh, P(*tuple(spec)[::-1])), 2
  )
  hlo = fn.lower(placed).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
  "rows, cols",
  [(16, 16), (128, 64), (144, 80), (16, 4096), (4096, 16), (1040, 2064), (16384, 4096)],
)
def test_kernel_is_the_transpose(rows, cols, dtype):
  for codes in (random_codes(rows * 7 + cols, rows, cols, dtype), every_byte(rows, cols, dtype)):
    assert_transposed(jax.jit(kernels.transpose_codes)(codes), codes)


@on_gpu
def test_kernel_lowers_to_the_ffi_call():
  hlo = jax.jit(kernels.transpose_codes).lower(jnp.zeros((32, 32), jnp.uint8)).as_text()
  assert "jaxquant_transpose_codes" in hlo
