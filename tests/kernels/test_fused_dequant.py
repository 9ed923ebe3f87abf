"""The fused-dequantize GEMM (MXFP8 / NVFP4 in any pairing, A with at most 32 rows): its
reference lowering against a NumPy oracle, its input checks and partitioning, and (on a
Hopper GPU) the kernel against the oracle, directly and through `ops.gemm`."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_cases import BF16_MMA_TOLERANCE, edge_input, random_input, relative_error

import jaxquant
from jaxquant import kernels, reference
from jaxquant.kernels import _fused_dequant as fd
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer
from jaxquant.roles import QuantizerRole
from jaxquant.tensor import QuantizedData

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")

FORMATS = {
  "mxfp8_e4m3": MXFP8Quantizer(),
  "mxfp8_e5m2": MXFP8Quantizer("e5m2"),
  "nvfp4": NVFP4Quantizer(),
  "nvfp4_16x16": NVFP4Quantizer(tile_2d=True),
  "nvfp4_per_token": NVFP4Quantizer(per_token=True),
}
PAIRS = list(itertools.product(FORMATS, FORMATS))
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


@functools.partial(jax.jit, static_argnames="name")
def quantize(x, name):
  """Jitted: eagerly, the reference NVFP4 cast compiles op by op (about 13 s a shape on a CPU).
  The GEMM and the oracle both take the stored operands, so either way checks them."""
  return reference.quantize(x, FORMATS[name], ("rowwise",)).rowwise


def oracle_values(qd) -> np.ndarray:
  """Element by element in float64: code times its block's scale (times S_dec for NVFP4)."""
  rows = qd.data.shape[0]
  if qd.format.packed:
    packed = np.asarray(qd.data)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, -1)
    codes = np.where(nibbles & 8, -1.0, 1.0) * E2M1_VALUES[nibbles & 7]
    scales = np.asarray(qd.scale_inv).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  else:
    codes = np.asarray(qd.data).astype(np.float64)
    e = np.asarray(qd.scale_inv).view(np.uint8).astype(np.float64)
    scales = np.where(e == 255, np.nan, np.exp2(e - 127))
  block_rows, block_cols = qd.format.block
  scales = np.repeat(np.repeat(scales, block_rows, axis=0)[:rows], block_cols, axis=1)
  values = codes * scales
  if qd.format.packed:  # S_dec, per tensor or per row: an input of the GEMM, as stored
    s_dec = np.asarray(reference.nvfp4.decode_scale(qd), np.float64)
    values = values * (s_dec.reshape(-1, 1) if s_dec.ndim else s_dec)
  return values


def oracle(a, b) -> np.ndarray:
  with np.errstate(invalid="ignore"):
    return oracle_values(a) @ oracle_values(b).T


def operands(seed, m, n, k, a_name, b_name, *, edges=False):
  x = (
    edge_input((m, k), jnp.float32, nan=True, inf=False)
    if edges
    else random_input(seed, (m, k), jnp.float32)
  )
  w = random_input(seed + 1, (n, k), jnp.float32)
  return quantize(x, a_name), quantize(w, b_name)


def assert_close(got, want, tolerance):
  got = np.asarray(got, np.float64)
  assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
  finite = ~np.isnan(want)
  assert relative_error(got[finite], want[finite]) <= tolerance


# ---- The reference lowering and the checks (every platform) ----


@pytest.mark.parametrize("a_name,b_name", PAIRS)
def test_reference_lowering_matches_oracle(a_name, b_name):
  with jax.default_device(jax.devices("cpu")[0]):
    a, b = operands(1, 16, 48, 256, a_name, b_name)
    got = jax.jit(lambda a, b: fd.dequant_gemm(a, b))(a, b)
  assert_close(got, oracle(a, b), 1e-6)


def test_rejects_bad_input():
  # Operands and calls traced only (jax.eval_shape): the checks read shapes and formats.
  a, b = jax.eval_shape(lambda: operands(0, 16, 32, 256, "mxfp8_e4m3", "nvfp4"))
  tall, _ = jax.eval_shape(lambda: operands(0, 48, 32, 256, "mxfp8_e4m3", "nvfp4"))
  short_k, _ = jax.eval_shape(lambda: operands(0, 16, 32, 96, "mxfp8_e4m3", "nvfp4"))
  fp8 = jax.eval_shape(
    lambda: reference.quantize(jnp.ones((16, 256)), Float8Quantizer(), ("rowwise",)).rowwise
  )
  gemm = lambda a, b, **options: jax.eval_shape(functools.partial(fd.dequant_gemm, **options), a, b)
  with pytest.raises(ValueError, match="A has 48 rows; the kernel takes at most 32"):
    gemm(tall, b)
  with pytest.raises(ValueError, match="K = 96 must be a multiple of 128"):
    gemm(short_k, short_k)
  with pytest.raises(ValueError, match="contraction dims differ: A has K=256, B has K=96"):
    gemm(a, short_k)
  with pytest.raises(ValueError, match="A is fp8_tensor; the kernel takes MXFP8 and NVFP4"):
    gemm(fp8, b)
  with pytest.raises(ValueError, match="the output dtype must be bfloat16 or float32, got float16"):
    gemm(a, b, out_dtype=jnp.float16)
  gemm(a, b)  # the valid pair passes the checks


def _mesh(devices):
  from jax.sharding import Mesh

  return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize(
  "b_name,kept", [("nvfp4", True), ("mxfp8_e4m3", True), ("nvfp4_16x16", False)]
)
def test_sharded_weight_rows(eight_devices, b_name, kept):
  """B's rows stay on their devices when its scales are per row; the numbers are those of
  one device (A is whole either way)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  a, b = operands(5, 8, 256, 256, "nvfp4_per_token", b_name)
  run = jax.jit(lambda a, b: fd.dequant_gemm(a, b))
  want = np.asarray(run(a, b), np.float64)
  b_sharded = jax.tree.map(
    lambda t: jax.device_put(t, NamedSharding(mesh, P("model"))) if t.ndim else t, b
  )
  assert relative_error(run(a, b_sharded), want) <= 1e-6
  config = fd.DequantGemmConfig(a.format, b.format, "float32")
  shape = lambda t, spec: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=NamedSharding(mesh, spec))
  args = [
    shape(a.data, P()),
    shape(a.scale_inv, P()),
    shape(jnp.ones((8,)), P()),
    shape(b.data, P("model")),
    shape(b.scale_inv, P("model")),
    shape(jnp.ones(()), P()),
  ]
  arg_specs, (out,), _ = fd._partition(config, mesh, args, None)
  dims = lambda spec: (tuple(spec) + (None, None))[:2]
  assert dims(arg_specs[3]) == ("model" if kept else None, None)
  assert dims(out) == (None, "model" if kept else None)


# ---- The CUDA kernel (Hopper only) ----

CODE_FORMATS = {
  "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
  "mxfp8_e5m2": ml_dtypes.float8_e5m2,
  "nvfp4": None,
}


def coded(name, codes, scale_codes):
  """QuantizedData from explicit codes [rows, K] (uint8, one code each) and scale bytes
  [rows, K / block]; NVFP4's S_dec is 1 (global amax 448 * 6)."""
  fmt = FORMATS[name].format("rowwise")
  if fmt.packed:
    data = jnp.asarray((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    scales = jnp.asarray(scale_codes.view(ml_dtypes.float8_e4m3fn))
    return QuantizedData(data, scales, jnp.float32(448.0 * 6), fmt)
  data = jnp.asarray(codes.view(CODE_FORMATS[name]))
  return QuantizedData(data, jnp.asarray(scale_codes.view(ml_dtypes.float8_e8m0fnu)), None, fmt)


def finite_codes(name, n):
  """n codes cycling through every finite code of the format (NaN / Inf codes left out:
  they are the edge-case test's), as uint8."""
  if name == "nvfp4":
    every = np.arange(16)
  else:
    every = np.arange(256)
    values = every.astype(np.uint8).view(CODE_FORMATS[name]).astype(np.float32)
    every = every[np.isfinite(values)]
  return np.resize(every, n).astype(np.uint8)


def unit_scales(name, rows, k):
  block = 16 if name == "nvfp4" else 32
  return np.full((rows, k // block), 0x38 if name == "nvfp4" else 127, np.uint8)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("large_scales", [False, True], ids=["fast_decode", "with_large_scales"])
@pytest.mark.parametrize("codes_on", ["A", "B"])
@pytest.mark.parametrize("name", list(CODE_FORMATS))
@pytest.mark.parametrize("other", ["mxfp8_e4m3", "nvfp4"])
def test_kernel_decodes_every_code_exactly(name, other, codes_on, large_scales):
  """Every finite code under small to large scales, multiplied by a one-hot operand of the
  other format: each output is one product, code * scale, so the kernel's fp32 result must
  equal the oracle bit for bit (subnormal codes and scales included). E8M0 scales above
  2^7 (E4M3) / 2^15 (E5M2) send a warp to the exact decode path (Fp8Bits)."""
  m, n, k = 16, 256, 256
  block = 16 if name == "nvfp4" else 32
  rng = np.random.default_rng(0)
  rows = m if codes_on == "A" else n
  codes = np.stack([np.roll(finite_codes(name, k), r) for r in range(rows)])
  if name == "nvfp4":  # E4M3 scales: subnormal, small, one, the largest
    scale_codes = rng.choice(np.uint8([0x01, 0x07, 0x20, 0x38, 0x7E]), (rows, k // block))
  else:  # E8M0 from 2^-107: smaller scales can put code * scale below fp32's normals (the
    # CPU reference flushes those) or between bf16's subnormals
    options = [20, 90, 127, 134] + ([150, 200] if large_scales else [])
    scale_codes = rng.choice(np.uint8(options), (rows, k // block))
  one = 2 if other == "nvfp4" else 0x38  # the code of 1.0 in E2M1 / E4M3
  one_hot_rows = n if codes_on == "A" else m
  one_hot = np.where(np.arange(one_hot_rows)[:, None] == np.arange(k)[None, :], one, 0).astype(
    np.uint8
  )
  coded_op = coded(name, codes, scale_codes)
  one_hot_op = coded(other, one_hot, unit_scales(other, one_hot_rows, k))
  a, b = (coded_op, one_hot_op) if codes_on == "A" else (one_hot_op, coded_op)
  got = np.asarray(jax.jit(lambda a, b: fd.dequant_gemm(a, b))(a, b))
  want = oracle(a, b).astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# (M, N, K): one row, partial m16 / n8 / 128-row tiles, one chunk, split K, 32 rows.
SHAPES = [
  (1, 8, 128),
  (5, 200, 384),
  (16, 1000, 2048),
  (16, 1024, 1024),
  (17, 136, 4096),
  (32, 256, 256),
]


def _tiles_fit(m, n, a_name, b_name):
  """16x16-tiled NVFP4 needs whole tiles of rows."""
  return all(rows % 16 == 0 for rows, name in ((m, a_name), (n, b_name)) if name == "nvfp4_16x16")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
  "m,n,k,a_name,b_name",
  [(*shape, a, b) for shape in SHAPES for a, b in PAIRS if _tiles_fit(shape[0], shape[1], a, b)],
)
def test_kernel_matches_oracle(m, n, k, a_name, b_name):
  a, b = operands(m * n + k, m, n, k, a_name, b_name)
  got = jax.jit(lambda a, b: fd.dequant_gemm(a, b))(a, b)
  assert_close(got, oracle(a, b), BF16_MMA_TOLERANCE)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
  "a_name,b_name",
  [
    ("mxfp8_e4m3", "nvfp4"),
    ("nvfp4", "mxfp8_e5m2"),
    ("mxfp8_e5m2", "mxfp8_e4m3"),
    ("nvfp4_per_token", "nvfp4"),
  ],
)
def test_kernel_edge_cases_and_bf16_output(a_name, b_name):
  """NUMERICS.md's edge rows (zeros, subnormals, ties, tiny values, a NaN) in A; a bf16
  output rounds the same sums once more."""
  a, b = operands(3, 16, 264, 512, a_name, b_name, edges=True)
  want = oracle(a, b)
  assert_close(jax.jit(lambda a, b: fd.dequant_gemm(a, b))(a, b), want, BF16_MMA_TOLERANCE)
  got16 = jax.jit(lambda a, b: fd.dequant_gemm(a, b, out_dtype=jnp.bfloat16))(a, b)
  assert got16.dtype == jnp.bfloat16
  assert_close(got16.astype(jnp.float32), want, BF16_MMA_TOLERANCE + 2.0**-9)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m,n,uses_kernel", [(16, 512, True), (512, 24, True), (64, 512, False)])
def test_gemm_dispatch(m, n, uses_kernel):
  """ops.gemm takes the kernel when either side has at most 32 rows (D^T = B . A^T when it
  is B), and otherwise the dequantize kernel before XLA's bf16 GEMM; every route matches
  the oracle."""
  a, b = operands(11, m, n, 512, "mxfp8_e4m3", "nvfp4")
  run = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.float32))
  text = run.lower(a, b).as_text()
  assert ("jaxquant_dequant_gemm" in text) == uses_kernel
  assert ("jaxquant_dequantize" in text) != uses_kernel
  assert_close(run(a, b), oracle(a, b), BF16_MMA_TOLERANCE)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("a_name,b_name", PAIRS)
def test_dequantize_first_route_matches_oracle(a_name, b_name):
  """More than 32 rows on both sides: the dequantize kernel (block scales only) and XLA's
  bf16 GEMM, S_dec in the epilogue; 16x16 tiles and per-token rows included, sizes that
  fill no 128-wide GEMM tile, fp32 and bf16 outputs, NaN rows passed through."""
  a, b = operands(21, 80, 208, 512, a_name, b_name, edges=True)
  want = oracle(a, b)
  run = jax.jit(lambda a, b, dtype: gemm_ops.gemm(a, b, out_dtype=dtype), static_argnums=2)
  assert "jaxquant_dequantize" in run.lower(a, b, jnp.float32).as_text()
  assert_close(run(a, b, jnp.float32), want, BF16_MMA_TOLERANCE)
  got16 = run(a, b, jnp.bfloat16)
  assert got16.dtype == jnp.bfloat16
  assert_close(got16.astype(jnp.float32), want, BF16_MMA_TOLERANCE + 2.0**-9)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
  "recipe", [jaxquant.recipes.mxfp8, jaxquant.recipes.nvfp4], ids=lambda r: r.name
)
def test_dense_decode_reaches_the_kernel(recipe):
  """`dense` of 16 tokens (inference) under MXFP8 / NVFP4 runs this kernel and matches the
  oracle of its two rowwise operands."""
  x = random_input(31, (16, 512), jnp.float32).astype(jnp.bfloat16)
  kernel = (random_input(32, (512, 384), jnp.float32) * 0.05).astype(jnp.bfloat16)
  f = jax.jit(
    lambda x, k: jaxquant.dense(x, k, recipe=recipe, name="decode", key=jax.random.key(0))
  )
  assert "jaxquant_dequant_gemm" in f.lower(x, kernel).as_text()
  qs = {t: recipe.qfactory(QuantizerRole("linear", t, "decode")) for t in ("input", "weight")}
  a = reference.quantize(x, qs["input"], ("rowwise",)).rowwise
  b = reference.quantize(kernel.T, qs["weight"], ("rowwise",)).rowwise
  assert_close(f(x, kernel).astype(jnp.float32), oracle(a, b), BF16_MMA_TOLERANCE + 2.0**-9)
