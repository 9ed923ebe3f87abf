"""The per-tensor FP8 GEMM primitive (cuBLASLt): its reference lowering against a NumPy
oracle and against `ops.gemm`'s reference, its input checks, its partitioning, and (on a
Hopper GPU) the kernel against the oracle, directly and through `ops.gemm`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import FP8_MMA_TOLERANCE, relative_error

from jaxquant import kernels, reference
from jaxquant.kernels import _tensor_gemm as tg
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import Float8Quantizer

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
pair_id = lambda p: f"{jnp.dtype(p[0]).name}x{jnp.dtype(p[1]).name}"


def codes_and_scales(seed, m, n, k, pair=(E4M3, E4M3)):
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.standard_normal((m, k)) * 8, pair[0])
  b = jnp.asarray(rng.standard_normal((n, k)) * 8, pair[1])
  sa = jnp.asarray(rng.uniform(0.5, 2.0) * 2.0**-7, jnp.float32)
  sb = jnp.asarray(rng.uniform(0.5, 2.0) * 2.0**3, jnp.float32)
  return a, b, sa, sb


def oracle(a, b, sa, sb):
  """Codes to float64, their product, then the two scales (float64 throughout)."""
  a64, b64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (a, b))
  return (a64 @ b64.T) * float(sa) * float(sb)


# (M, N, K): one row, rows and columns that fill no tile, a decode-like M, a square.
SHAPES = [(1, 16, 16), (17, 48, 80), (300, 264, 640), (16, 1024, 2048), (256, 256, 256)]


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_reference_lowering_matches_oracle(m, n, k, pair):
  args = jax.device_put(codes_and_scales(m + n + k, m, n, k, pair), jax.devices("cpu")[0])
  got = jax.jit(tg.fp8_tensor_gemm)(*args)
  want = oracle(*args)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_reference_lowering_is_the_gemm_reference(out_dtype):
  """Bit for bit the emulation `ops.gemm` defines for per-tensor FP8 operands."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((96, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
  cpu = jax.devices("cpu")[0]
  # Jitted: eagerly the reference cast compiles op by op.
  quantize = jax.jit(lambda x, q: reference.quantize(x, q, ("rowwise",)).rowwise, static_argnums=1)
  a = jax.device_put(quantize(x, Float8Quantizer()), cpu)
  b = jax.device_put(quantize(w, Float8Quantizer(element="e5m2")), cpu)
  got = jax.jit(
    lambda a, b: tg.fp8_tensor_gemm(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=out_dtype)
  )(a, b)
  want = jax.jit(lambda a, b: gemm_ops.reference_gemm(a, b, out_dtype=out_dtype))(a, b)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_reference_lowering_ignores_fast_accumulation():
  """The reference's sums are exact: fast accumulation is the kernel's alone."""
  args = jax.device_put(codes_and_scales(3, 64, 48, 256), jax.devices("cpu")[0])
  fast = jax.jit(lambda *a: tg.fp8_tensor_gemm(*a, fast_accumulation=True))(*args)
  np.testing.assert_array_equal(np.asarray(fast), np.asarray(jax.jit(tg.fp8_tensor_gemm)(*args)))
  with pytest.raises(TypeError, match="fast_accumulation must be a bool, got 1"):
    tg.fp8_tensor_gemm(*args, fast_accumulation=1)


def test_rejects_bad_input():
  a, b, sa, sb = codes_and_scales(0, 16, 32, 64)
  with pytest.raises(
    ValueError, match="operands must be float8_e4m3fn or float8_e5m2, got bfloat16"
  ):
    tg.fp8_tensor_gemm(a.astype(jnp.bfloat16), b, sa, sb)
  with pytest.raises(ValueError, match="E5M2 x E5M2 has no FP8 tensor-core GEMM"):
    tg.fp8_tensor_gemm(a.astype(E5M2), b.astype(E5M2), sa, sb)
  with pytest.raises(ValueError, match="K = 24 must be a multiple of 16"):
    tg.fp8_tensor_gemm(a[:, :24], b[:, :24], sa, sb)
  with pytest.raises(ValueError, match="N = 10 must be a multiple of 8 for a bfloat16 output"):
    tg.fp8_tensor_gemm(a, b[:10], sa, sb, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="the output dtype must be bfloat16 or float32, got float16"):
    tg.fp8_tensor_gemm(a, b, sa, sb, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"B's scale must be a float32 scalar, got float32\[1\]"):
    tg.fp8_tensor_gemm(a, b, sa, sb.reshape(1))
  with pytest.raises(ValueError, match="contraction dims differ: A has K=64, B has K=32"):
    tg.fp8_tensor_gemm(a, b[:, :32], sa, sb)


# (A spec, B spec, N, A stays row-sharded, B stays row-sharded, K stays split): a K split
# alike in A and B stays split; a K split otherwise is gathered; one mesh axis cannot split
# both output dims; 24 rows over 4 shards are kept whole.
SHARDED_CASES = [
  (("data", None), ("model", None), 256, True, True, False),
  (("data", None), (None, None), 256, True, False, False),
  ((None, "model"), (None, None), 256, False, False, False),
  (("data", None), ("data", None), 256, True, False, False),
  (("data", None), ("model", None), 24, True, False, False),
  ((None, "model"), (None, "model"), 256, False, False, True),
  (("data", "model"), (None, "model"), 256, True, False, True),
  (("model", "data"), (None, "data"), 256, True, False, True),
  ((None, "data"), ("data", None), 256, False, True, False),
]


def _mesh(devices):
  from jax.sharding import Mesh

  return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize("a_spec,b_spec,n,a_kept,b_kept,k_kept", SHARDED_CASES, ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_sharded_operands_give_the_unsharded_result(
  eight_devices, a_spec, b_spec, n, a_kept, b_kept, k_kept, out_dtype
):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  a, b, sa, sb = codes_and_scales(9, 256, n, 384)
  run = jax.jit(lambda *args: tg.fp8_tensor_gemm(*args, out_dtype=out_dtype))
  want = np.asarray(run(a, b, sa, sb), np.float64)
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  got = np.asarray(run(shard(a, a_spec), shard(b, b_spec), sa, sb), np.float64)
  # Sums in another order; a bf16 result split over K sums its shards' rounded partial
  # products: within a bf16 ulp of the one-device result, normwise.
  assert relative_error(got, want) <= (1e-6 if out_dtype == jnp.float32 else 2.0**-8)


def test_split_k_sums_reduce_scatter_where_the_result_is_wanted_split(eight_devices):
  """A weight gradient under data parallelism: its tokens (K) split, the result wanted
  split over the same axis; the partial products are reduce-scattered, nothing gathered."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  a, b, sa, sb = codes_and_scales(10, 256, 128, 384)
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  out = NamedSharding(mesh, P("data", None))
  run = jax.jit(lambda *args: tg.fp8_tensor_gemm(*args, out_dtype=jnp.bfloat16), out_shardings=out)
  args = (shard(a, (None, "data")), shard(b, (None, "data")), sa, sb)
  hlo = run.lower(*args).compile().as_text()
  assert re.search(r"\[128,128\][^ ]* reduce-scatter", hlo), "no reduce-scatter"
  assert "all-gather" not in hlo
  want = np.asarray(
    jax.jit(lambda *args: tg.fp8_tensor_gemm(*args, out_dtype=jnp.bfloat16))(a, b, sa, sb),
    np.float64,
  )
  assert relative_error(np.asarray(run(*args), np.float64), want) <= 2.0**-8


@pytest.mark.parametrize("a_spec,b_spec,n,a_kept,b_kept,k_kept", SHARDED_CASES, ids=str)
def test_partition_keeps_rows_sharded(eight_devices, a_spec, b_spec, n, a_kept, b_kept, k_kept):
  """What each device gets: its rows of A and of B where whole 16-row multiples, its part of
  a K split alike in both (else the whole of K), the scalar scales."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  shape = lambda dims, dtype, spec: jax.ShapeDtypeStruct(
    dims, dtype, sharding=NamedSharding(mesh, P(*spec))
  )
  arg_shapes = [
    shape((256, 384), E4M3, a_spec),
    shape((n, 384), E4M3, b_spec),
    shape((), jnp.float32, ()),
    shape((), jnp.float32, ()),
  ]
  (a_got, b_got, sa_got, sb_got), (out,), _ = tg._partition(
    tg.Fp8GemmConfig(out_dtype="float32"), mesh, arg_shapes, None
  )
  rows = lambda spec: (tuple(spec) + (None,))[0]
  k_of = lambda spec: (tuple(spec) + (None, None))[1]
  for what, got, want_spec, kept in (("A", a_got, a_spec, a_kept), ("B", b_got, b_spec, b_kept)):
    assert k_of(got) == (a_spec[1] if k_kept else None), f"{what}'s K: {got}"
    assert rows(got) == (want_spec[0] if kept else None), f"{what}: {got}"
  assert tuple(sa_got) == tuple(sb_got) == ()
  assert (tuple(out) + (None, None))[:2] == (rows(a_got), rows(b_got))


# ---- The cuBLASLt call (Hopper only) ----


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("m,n,k", SHAPES + [(2048, 1024, 4096)])
def test_kernel_matches_oracle(m, n, k, pair, out_dtype):
  args = codes_and_scales(7 * m + k, m, n, k, pair)
  got = jax.jit(lambda *a: tg.fp8_tensor_gemm(*a, out_dtype=out_dtype))(*args)
  assert (
    "jaxquant_fp8_tensor_gemm" in jax.jit(lambda *a: tg.fp8_tensor_gemm(*a)).lower(*args).as_text()
  )
  bf16_rounding = 2.0**-9 if out_dtype == jnp.bfloat16 else 0.0
  assert relative_error(got, oracle(*args)) <= FP8_MMA_TOLERANCE + bf16_rounding


@pytest.mark.gpu
@on_gpu
def test_kernel_fast_accumulation_takes_effect_within_its_accuracy():
  """cuBLASLt's FAST_ACCUM reaches the kernel: on all-positive codes, whose truncated
  partial sums add up instead of cancelling, its error is far above that of promoted
  (split) accumulation (H100, k = 4096: 6.7e-2 against 4.2e-4); on signed codes it stays
  within 2^-8 (measured 1.1e-3) while split accumulation meets FP8_MMA_TOLERANCE."""
  m = n = 512
  k = 4096
  errors = {}
  for data in ("signed", "positive"):
    a, b, sa, sb = codes_and_scales(13, m, n, k, (E4M3, E5M2))
    if data == "positive":
      a, b = (
        jnp.abs(a.astype(jnp.float32)).astype(E4M3),
        jnp.abs(b.astype(jnp.float32)).astype(E5M2),
      )
    want = oracle(a, b, sa, sb)
    for fast in (False, True):
      got = jax.jit(lambda *x, fast=fast: tg.fp8_tensor_gemm(*x, fast_accumulation=fast))(
        a, b, sa, sb
      )
      errors[data, fast] = relative_error(got, want)
  assert errors["signed", False] <= FP8_MMA_TOLERANCE, errors
  assert errors["signed", True] <= 2.0**-8, errors
  assert errors["positive", True] > 10 * errors["positive", False], errors


@pytest.mark.gpu
@on_gpu
def test_kernel_edge_values():
  """Zeros give zeros, a NaN code reaches exactly its row and column, the largest codes
  times the scales stay finite in fp32 (no intermediate overflow)."""
  a, b, sa, sb = codes_and_scales(11, 64, 32, 128)
  a = a.at[3].set(jnp.zeros((128,), E4M3)).at[5, 7].set(jnp.nan)
  b = b.at[2, 9].set(jnp.nan)
  got = np.asarray(jax.jit(tg.fp8_tensor_gemm)(a, b, sa, sb))
  nan = np.zeros(got.shape, bool)
  nan[5, :] = nan[:, 2] = True
  np.testing.assert_array_equal(np.isnan(got), nan)
  assert (got[3, np.arange(32) != 2] == 0).all()
  big = jnp.full((16, 64), 448.0, E4M3)
  out = np.asarray(
    jax.jit(tg.fp8_tensor_gemm)(big, big, jnp.float32(2.0**120), jnp.float32(2.0**-120))
  )
  np.testing.assert_array_equal(out, np.full((16, 16), 448.0 * 448.0 * 64, np.float32))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_gemm_dispatch_uses_kernel(out_dtype):
  """fp8_current operands through ops.gemm: the cuBLASLt kernel, within FP8 accumulation of
  the reference; a shape cuBLASLt cannot take (K = 40) goes to XLA's dot instead."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((768, 1024)), jnp.bfloat16)
  q = lambda t: reference.quantize(t, Float8Quantizer(), ("rowwise",)).rowwise
  a, b = q(x), q(w)
  run = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=out_dtype))
  assert "jaxquant_fp8_tensor_gemm" in run.lower(a, b).as_text()
  want = np.asarray(jax.jit(lambda a, b: gemm_ops.reference_gemm(a, b))(a, b), np.float64)
  bf16_rounding = 2.0**-9 if out_dtype == jnp.bfloat16 else 0.0
  assert relative_error(run(a, b), want) <= FP8_MMA_TOLERANCE + bf16_rounding
  a40, b40 = q(x[:, :40]), q(w[:, :40])
  assert "jaxquant_fp8_tensor_gemm" not in run.lower(a40, b40).as_text()
  want40 = np.asarray(jax.jit(lambda a, b: gemm_ops.reference_gemm(a, b))(a40, b40), np.float64)
  assert relative_error(run(a40, b40), want40) <= 1e-3 + bf16_rounding
