"""Hybrid pairs, jit vs eager, vmap, round-trip error bounds and input validation."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle as orc
import pytest
import ref_cases as rc

from jaxquant import recipes, reference, scaling
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)
from jaxquant.roles import QuantizerRole
from jaxquant.tensor import QuantizedData

KEY = jax.random.key(7)
SHAPE = (64, 128)

HYBRIDS = [
  HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True, stochastic_rounding=True)),
  HybridQuantizer(NVFP4Quantizer(per_token=True), MXFP8Quantizer("e5m2")),
  HybridQuantizer(Float8Quantizer(), BlockFloat8Quantizer(block="128x128")),
  HybridQuantizer(None, Float8Quantizer("e5m2")),
  HybridQuantizer(BlockFloat8Quantizer(), None),
  HybridQuantizer(None, None),
]


@pytest.mark.parametrize("q", HYBRIDS, ids=str)
def test_hybrid_pairs(q):
  """Each usage is its own format, computed from the original tensor; None keeps that usage
  in high precision (stored layout, original dtype)."""
  rng = np.random.default_rng(31)
  dtype = rc.DTYPES["bf16"]
  for x in (
    rc.random_input(rng, SHAPE, dtype),
    rc.edge_suite(rng, SHAPE, dtype, "e4m3", 32, 448.0)["zero_and_subnormal_blocks"],
  ):
    rc.check_against_oracle(x, q, key=KEY)


def test_hybrid_with_delayed_side():
  q = HybridQuantizer(DelayedFloat8Quantizer(history_len=2), MXFP8Quantizer())
  st = scaling.DelayedScalingState(jnp.zeros(2), jnp.float32(3.5))
  x = rc.random_input(np.random.default_rng(32), SHAPE, rc.DTYPES["fp16"])
  _, new = rc.check_against_oracle(x, q, state=st)
  assert np.asarray(new.amax_history)[0] == orc.amax(orc.to_f32(x))


# One quantizer per family (plus the NVFP4 options): jit vs eager, vmap vs per example.
ALL = [
  Float8Quantizer(),
  BlockFloat8Quantizer(block="128x128"),
  MXFP8Quantizer("e5m2"),
  NVFP4Quantizer(tile_2d=True),
  NVFP4Quantizer(rht=True, stochastic_rounding=True, per_token=True),
  HybridQuantizer(MXFP8Quantizer(), None),
]


def _leaves_bits(tree):
  return [np.asarray(leaf).reshape(-1).view(np.uint8) for leaf in jax.tree_util.tree_leaves(tree)]


# Eager execution dispatches op by op (slow for the unrolled RHT): one dtype per quantizer,
# all three dtypes across the list.
@pytest.mark.parametrize(
  "q,dt", list(zip(ALL, ["bf16", "fp16", "fp32", "fp32", "bf16", "fp16"], strict=False)), ids=str
)
@pytest.mark.slow
def test_jit_matches_eager(q, dt):
  rng = np.random.default_rng(33)
  x = rc.random_input(rng, (32, 64), rc.DTYPES[dt])
  x.reshape(-1)[:40] = rc.subnormals(rng, (40,), rc.DTYPES[dt])  # exercise the exact paths
  eager = reference.quantize(jnp.asarray(x), q, key=KEY)
  jitted = rc.quantize_jit(jnp.asarray(x), q, rc.USAGES, key=KEY)
  for a, b in zip(_leaves_bits(eager), _leaves_bits(jitted), strict=False):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("q", ALL, ids=str)
def test_vmap_matches_per_example(q):
  rng = np.random.default_rng(34)
  xb = rc.random_input(rng, (3, 32, 64), rc.DTYPES["bf16"])
  xb[1] = rc.subnormals(rng, (32, 64), rc.DTYPES["bf16"])
  xb[2, 0, :3] = [np.inf, np.nan, -0.0]
  batched = jax.jit(jax.vmap(lambda x: reference.quantize(x, q, key=KEY)))(jnp.asarray(xb))
  for i in range(3):
    one = rc.quantize_jit(jnp.asarray(xb[i]), q, rc.USAGES, key=KEY)
    # Indexed on the host: an XLA slice of FP8 data may rewrite NaN payloads (JAX 0.11's
    # CPU backend turns E5M2 0x7E into 0x7F), and the test compares stored bits.
    host = jax.tree_util.tree_map(np.asarray, batched)
    got = jax.tree_util.tree_map(operator.itemgetter(i), host)
    for a, b in zip(_leaves_bits(got), _leaves_bits(one), strict=False):
      np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- round trip


def _bound(q, qt, usage, x_stored):
  """Per-element |x_hat - x| bound from the element grid and the usage's scales.

  FP8 with mantissa bits m and smallest subnormal step d: an element v = x * scale in range
  rounds with error <= max(|v| 2^-(m+1), d / 2), i.e. |x| 2^-(m+1) + (d/2) * scale_inv in
  x's units. NVFP4: the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} has half-gaps <= max(|v|/4,
  1/4), times the block's decode step D = s * S_dec, plus the clipping beyond 6 D when the
  E4M3 block scale rounded down. A 2^-20 relative slack covers the fp32 roundings of the
  scale and its inverse.
  """
  qd = getattr(qt, usage)
  ax = np.abs(x_stored)
  if isinstance(q, NVFP4Quantizer):
    values, outer = reference.split_scales(qd)
    block = (16, 16) if q.tile_2d else (1, 16)
    s = orc.fp8_decode(rc.scale_bits(qd), "e4m3")
    s_dec = np.asarray(outer, np.float32)
    step = orc.expand(s, block, ax.shape) * (s_dec[:, None] if s_dec.ndim else s_dec)
    return np.maximum(ax, step) / 4 + np.maximum(0, ax - 6 * step)
  m, d = {"e4m3": (3, 2.0**-9), "e5m2": (2, 2.0**-16)}[q.element]
  if isinstance(q, MXFP8Quantizer):
    e = rc.scale_bits(qd).astype(np.int32)
    inv = orc.expand(np.exp2(e - 127.0), (1, 32), ax.shape)
  elif isinstance(q, BlockFloat8Quantizer):
    block = (1, 128) if q.block == "1x128" else (128, 128)
    inv = orc.expand(np.asarray(qd.scale_inv, np.float64), block, ax.shape)
  else:
    inv = float(np.asarray(qd.scale_inv))
  return ax * 2.0 ** -(m + 1) + d / 2 * inv


ROUNDTRIP = [
  Float8Quantizer(),
  Float8Quantizer("e5m2", pow2_scales=True),
  BlockFloat8Quantizer(),
  BlockFloat8Quantizer("e5m2", "128x128"),
  MXFP8Quantizer(),
  MXFP8Quantizer("e5m2"),
  NVFP4Quantizer(),
  NVFP4Quantizer(tile_2d=True),
  NVFP4Quantizer(per_token=True),
]


@pytest.mark.parametrize("q", ROUNDTRIP, ids=str)
def test_round_trip_error_bound(q):
  rng = np.random.default_rng(35)
  x = rc.random_input(rng, (128, 256), rc.DTYPES["fp32"])
  qt = rc.quantize_jit(jnp.asarray(x), q, rc.USAGES)
  for usage in rc.USAGES:
    got = np.asarray(rc.dequantize_jit(qt, usage, jnp.float32)).reshape(-1, 256)
    stored = rc.stored_matrix(x, usage)
    bound = _bound(q, qt, usage, stored) * (1 + 2.0**-20)
    err = np.abs(got - stored.T if usage == "columnwise" else got - stored)
    err = err.T if usage == "columnwise" else err
    assert np.all(err <= bound), (usage, np.max(err / np.maximum(bound, 1e-38)))
    if isinstance(q, NVFP4Quantizer):  # normal E4M3 block scales clip by at most 2^-4
      s = orc.fp8_decode(rc.scale_bits(getattr(qt, usage)), "e4m3")
      assert np.mean(s >= 2.0**-6) > 0.9


# ---------------------------------------------------------------- bad input


def test_dims_not_divisible_by_the_block():
  with pytest.raises(ValueError, match=r"cols.*32.*48"):
    reference.quantize(jnp.ones((32, 48)), MXFP8Quantizer())
  with pytest.raises(ValueError, match=r"cols.*16.*40"):  # columnwise: M = 40 along its blocks
    reference.quantize(jnp.ones((40, 64)), NVFP4Quantizer(), "columnwise")
  with pytest.raises(ValueError, match=r"rows.*16.*40"):  # 16x16 tiles: the rows too
    reference.quantize(jnp.ones((40, 64)), NVFP4Quantizer(tile_2d=True), "rowwise")
  jax.eval_shape(
    lambda x: reference.quantize(x, BlockFloat8Quantizer(block="128x128")), jnp.ones((40, 200))
  )  # partial edge blocks: accepted


@pytest.mark.parametrize(
  "x",
  [
    jnp.ones((4, 32), jnp.int32),
    jnp.ones((4, 32), jnp.float8_e4m3fn),
    np.ones((4, 32), np.float64),
  ],
  ids=["int32", "float8", "float64"],
)
def test_unsupported_dtypes(x):
  with pytest.raises(TypeError, match=str(np.dtype(x.dtype))):
    reference.quantize(x, MXFP8Quantizer())


def test_rank_0_and_not_a_quantizer():
  with pytest.raises(ValueError, match="rank-0"):
    reference.quantize(jnp.float32(1.0), Float8Quantizer())
  with pytest.raises(TypeError, match="'e4m3'"):
    reference.quantize(jnp.ones((4, 32)), "e4m3")


def test_missing_key_or_state():
  with pytest.raises(ValueError, match="key"):
    reference.quantize(jnp.ones((32, 32)), NVFP4Quantizer(stochastic_rounding=True))
  with pytest.raises(ValueError, match="state"):
    reference.quantize(jnp.ones((32, 32)), DelayedFloat8Quantizer())


def test_per_token_only_rowwise():
  with pytest.raises(ValueError, match="per_token"):
    HybridQuantizer(rowwise=None, columnwise=NVFP4Quantizer(per_token=True))
  HybridQuantizer(rowwise=NVFP4Quantizer(per_token=True), columnwise=None)


def test_qfactory_must_return_a_quantizer():
  role = QuantizerRole("linear", "weight", "mlp/wi")
  bad = recipes.CustomRecipe(lambda r: "fp8", name="mine")
  with pytest.raises(TypeError, match=r"'fp8'.*weight.*mlp/wi|mlp/wi.*'fp8'"):
    bad.quantizer(role)


def test_outer_scales_of_a_pair_are_each_operands_own():
  """The GEMM's outer scales computed together (NVFP4's S_dec of both operands in one
  vectorized computation) have the bits of each operand's own, amaxes zero, subnormal,
  inf and NaN included, per tensor and per token, beside FP8 and high-precision operands."""
  amaxes = np.array([3.5, 0.0, 1e-40, np.inf, np.nan, 2688.0, 7e-3, 1e30], np.float32)
  per_tensor = NVFP4Quantizer().format("rowwise")
  per_token = NVFP4Quantizer(per_token=True).format("rowwise")
  fp8_tensor = Float8Quantizer().format("rowwise")
  data = jnp.zeros((8, 8), jnp.uint8)
  nvfp4 = lambda amax, fmt: QuantizedData(data, None, jnp.asarray(amax), fmt)
  operands = [nvfp4(amaxes[i], per_tensor) for i in range(len(amaxes))]
  operands += [
    nvfp4(amaxes, per_token),
    nvfp4(amaxes[::-1].copy(), per_token),
    QuantizedData(data, jnp.float32(0.125), None, fp8_tensor),
    jnp.ones((8, 8)),
  ]
  bits = lambda a: np.asarray(a, np.float32).view(np.uint32)
  for a in operands:
    for b in operands:
      together = jax.jit(reference.outer_scales)(a, b)
      for op, got in zip((a, b), together, strict=False):
        want = reference.outer_scale(op) if isinstance(op, QuantizedData) else None
        if want is None:
          assert got is None
        else:
          np.testing.assert_array_equal(bits(got), bits(want))
