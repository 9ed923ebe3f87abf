"""The scaled bf16 GEMM primitive (cuBLASLt, a device scalar times the sums): its reference
lowering against a NumPy oracle, its input checks, its partitioning, its place in
`ops.gemm` (NVFP4 GEMMs that dequantize first), and (on a Hopper GPU) the kernel bit for
bit against the oracle on operands whose sums are exact in any order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_cases import BF16_MMA_TOLERANCE, relative_error

from jaxquant import kernels, reference
from jaxquant.kernels import _bf16_gemm as sg
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import MXFP8Quantizer, NVFP4Quantizer

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
OUT_DTYPES = [jnp.float32, jnp.bfloat16]
dtype_id = lambda d: jnp.dtype(d).name


# Scales at NUMERICS.md's edges: signed zeros, infinities, NaN, one that overflows the
# product; and ordinary ones across fp32's range.
EDGE_SCALES = [0.0, -0.0, np.inf, -np.inf, np.nan, -3.0e38]
SCALES = EDGE_SCALES + [1.0, 0.37, -(2.0**40) * 1.3, 2.0**-40 * 1.7]


def integer_operands(seed, m, n, k):
  """bf16 integers in [-8, 8]: |sums| < 2^24 for k <= 2^17, exact in fp32 in any order."""
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.integers(-8, 9, (m, k)), jnp.bfloat16)
  b = jnp.asarray(rng.integers(-8, 9, (n, k)), jnp.bfloat16)
  return a, b


def oracle(a, b, scale, out_dtype):
  """Exact integer sums (float64), times the float32 scale in float32, rounded to out_dtype
  by ml_dtypes (round to nearest even)."""
  sums = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  with np.errstate(over="ignore", invalid="ignore"):  # infinite and NaN scales are cases
    scaled = sums.astype(np.float32) * np.float32(scale)
  return scaled.astype(ml_dtypes.bfloat16 if out_dtype == jnp.bfloat16 else np.float32)


def assert_same_bits(got, want, *, unsigned_zeros=False):
  """The same bits, NaNs compared as NaNs (their payloads are the hardware's); with
  `unsigned_zeros`, a +0 also stands for a -0 (the kernel's epilogue writes +0)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  g32, w32 = got.astype(np.float32), want.astype(np.float32)
  nan = np.isnan(w32)
  np.testing.assert_array_equal(np.isnan(g32), nan)
  bits = np.uint16 if got.dtype.itemsize == 2 else np.uint32
  same = (got.view(bits) == want.view(bits)) | nan
  if unsigned_zeros:
    same |= (w32 == 0) & (g32 == 0) & ~np.signbit(g32)
  assert same.all(), f"{(~same).sum()} of {same.size} differ, first at {np.argwhere(~same)[0]}"


# (M, N, K): one row, rows and columns that fill no tile, a square, a long K.
SHAPES = [(1, 16, 16), (17, 48, 80), (300, 264, 640), (256, 256, 256), (64, 128, 8192)]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_reference_lowering_matches_oracle(m, n, k, out_dtype):
  cpu = jax.devices("cpu")[0]
  a, b = jax.device_put(integer_operands(m + n + k, m, n, k), cpu)
  run = jax.jit(lambda *x: sg.scaled_bf16_gemm(*x, out_dtype=out_dtype))
  for scale in SCALES:
    assert_same_bits(
      run(a, b, jax.device_put(jnp.float32(scale), cpu)), oracle(a, b, scale, out_dtype)
    )


def test_rejects_bad_input():
  a, b = integer_operands(0, 16, 32, 64)
  s = jnp.float32(1.0)
  with pytest.raises(ValueError, match="operands must be bfloat16, got float32 and bfloat16"):
    sg.scaled_bf16_gemm(a.astype(jnp.float32), b, s)
  with pytest.raises(ValueError, match="K = 24 must be a multiple of 16"):
    sg.scaled_bf16_gemm(a[:, :24], b[:, :24], s)
  with pytest.raises(ValueError, match="N = 10 must be a multiple of 8 for a bfloat16 output"):
    sg.scaled_bf16_gemm(a, b[:10], s, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="the output dtype must be bfloat16 or float32, got float16"):
    sg.scaled_bf16_gemm(a, b, s, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"scale: expected float32\[\], got float32\[1\]"):
    sg.scaled_bf16_gemm(a, b, s.reshape(1))
  with pytest.raises(ValueError, match="contraction dims differ: A has K=64, B has K=32"):
    sg.scaled_bf16_gemm(a, b[:, :32], s)


def _mesh(devices):
  from jax.sharding import Mesh

  return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


# (A spec, B spec): tokens split, output features split, both, K split alike in both (a
# weight gradient under data parallelism), K split in A only (gathered).
SHARDED = [
  (("data", None), (None, None)),
  ((None, None), ("model", None)),
  (("data", None), ("model", None)),
  ((None, "data"), (None, "data")),
  ((None, "model"), (None, None)),
]


@pytest.mark.parametrize("a_spec,b_spec", SHARDED, ids=str)
def test_sharded_operands_give_the_unsharded_result(eight_devices, a_spec, b_spec):
  """fp32 output, exact sums and a power-of-two scale: a split K's scaled partial products
  add up exactly, so every layout gives the one-device bits."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  a, b = integer_operands(9, 256, 128, 384)
  scale = jnp.float32(2.0**-13)
  run = jax.jit(lambda *x: sg.scaled_bf16_gemm(*x, out_dtype=jnp.float32))
  want = run(a, b, scale)
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  assert_same_bits(run(shard(a, a_spec), shard(b, b_spec), scale), want)


def test_partition_keeps_rows_and_a_shared_k_split(eight_devices):
  """Each device gets its rows of A and of B, its part of a K split alike in both, and the
  scale."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  shape = lambda dims, dtype, spec: jax.ShapeDtypeStruct(
    dims, dtype, sharding=NamedSharding(mesh, P(*spec))
  )
  config = sg.ScaledGemmConfig(out_dtype="float32")
  alpha_beta = shape((2,), jnp.float32, ())
  args = [
    shape((256, 384), jnp.bfloat16, ("data", None)),
    shape((128, 384), jnp.bfloat16, ("model", None)),
    alpha_beta,
  ]
  (a_got, b_got, s_got), (out,), _ = sg._partition(config, mesh, args, None)
  assert (tuple(a_got), tuple(b_got), tuple(s_got), tuple(out)) == (
    ("data", None),
    ("model", None),
    (),
    ("data", "model"),
  )
  args = [
    shape((256, 384), jnp.bfloat16, (None, "data")),
    shape((128, 384), jnp.bfloat16, (None, "data")),
    alpha_beta,
  ]
  (a_got, b_got, _), _, _ = sg._partition(config, mesh, args, None)
  assert (tuple(a_got), tuple(b_got)) == ((None, "data"), (None, "data"))


def _nvfp4_pair(seed, per_token=False):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
  a = reference.quantize(x, NVFP4Quantizer(per_token=per_token), ("rowwise",)).rowwise
  b = reference.quantize(w, NVFP4Quantizer(), ("rowwise",)).rowwise
  return a, b


def test_dequantize_first_gemm_lowers_per_tensor_outer_scales_to_the_kernel(cuda_library_stand_in):
  """For CUDA, an NVFP4 GEMM that dequantizes first hands its S_dec to this kernel; one
  with per-token rows (a scale per output row) or with no outer scale (MXFP8) keeps
  XLA's dot. Lowered without a GPU: the library is stood in for."""
  # The operands only traced (their shapes, formats and scales' layout), never computed.
  lowered = lambda operands: (
    jax.jit(gemm_ops._dequantize_first_gemm)
    .trace(*jax.eval_shape(operands))
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  assert "@jaxquant_scaled_bf16_gemm(" in lowered(lambda: _nvfp4_pair(1))
  assert "@jaxquant_scaled_bf16_gemm(" not in lowered(lambda: _nvfp4_pair(1, per_token=True))
  q = MXFP8Quantizer()
  mx = lambda rows: reference.quantize(jnp.ones((rows, 256), jnp.bfloat16), q, ("rowwise",)).rowwise
  assert "@jaxquant_scaled_bf16_gemm(" not in lowered(lambda: (mx(128), mx(64)))


# ---- The cuBLASLt call (Hopper only) ----


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m,n,k", SHAPES + [(2048, 1024, 4096)])
def test_kernel_matches_the_reference_bit_for_bit(m, n, k, out_dtype):
  """Exact sums, so the only rounding is that of the scaled sum: the oracle's bits for
  every scale, NaN, infinite, zero and overflowing ones included (cuBLASLt reads its beta,
  0, from the device: D's old contents must not reach the result), and subnormal products
  (XLA:GPU's own epilogue keeps them; XLA:CPU flushes them, so the reference lowering's
  test leaves them out). One deviation, measured on the H100: a -0 result (a zero or
  negative scale times a sum of its sign's opposite or zero) comes out +0."""
  a, b = integer_operands(7 * m + k, m, n, k)
  run = jax.jit(lambda *x: sg.scaled_bf16_gemm(*x, out_dtype=out_dtype))
  assert "jaxquant_scaled_bf16_gemm" in run.lower(a, b, jnp.float32(1.0)).as_text()
  for scale in SCALES + [2.0**-149, -(2.0**-140)]:
    want = oracle(a, b, scale, out_dtype)
    got = run(a, b, jnp.float32(scale))
    assert_same_bits(got, want, unsigned_zeros=True)
    if scale > 0:  # NVFP4's scales (products of S_dec) are positive: no -0 from them
      assert_same_bits(got, want)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
def test_nvfp4_gemm_takes_the_kernel_within_bf16_accumulation(out_dtype):
  """NVFP4 x NVFP4 through ops.gemm: the dequantize kernel, then this GEMM with both S_dec,
  within bf16 tensor-core accumulation of the reference."""
  a, b = _nvfp4_pair(3)
  run = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=out_dtype))
  assert "jaxquant_scaled_bf16_gemm" in run.lower(a, b).as_text()
  want = np.asarray(jax.jit(lambda a, b: gemm_ops.reference_gemm(a, b))(a, b), np.float64)
  bf16_rounding = 2.0**-9 if out_dtype == jnp.bfloat16 else 0.0
  assert relative_error(run(a, b), want) <= BF16_MMA_TOLERANCE + bf16_rounding
