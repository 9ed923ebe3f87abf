"""Per-tensor FP8 (current and delayed scaling) and block FP8 against the numpy oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle as orc
import pytest
import ref_cases as rc

from jaxquant import scaling
from jaxquant.quantizers import BlockFloat8Quantizer, DelayedFloat8Quantizer, Float8Quantizer

SQUARE = (128, 128)  # square: the transposed edge tensors reuse the same compile

# (quantizer, dtype) pairs: every option is covered without compiling the full cross product.
CURRENT = [
  (Float8Quantizer("e4m3"), "bf16"),
  (Float8Quantizer("e4m3"), "fp16"),
  (Float8Quantizer("e4m3"), "fp32"),
  (Float8Quantizer("e5m2"), "bf16"),
  (Float8Quantizer("e5m2"), "fp32"),
  (Float8Quantizer("e4m3", pow2_scales=True), "fp32"),
  (Float8Quantizer("e5m2", eps=1e-2, pow2_scales=True), "fp16"),
]


@pytest.mark.parametrize("q,dt", CURRENT, ids=lambda v: str(v))
def test_current_scaling_edge_cases(q, dt):
  rng = np.random.default_rng(1)
  dtype = rc.DTYPES[dt]
  top = float(orc.FMAX[q.element])  # amax == fmax: scale 1, so the pool's ties stay ties
  cases = rc.edge_suite(rng, SQUARE, dtype, q.element, SQUARE[1], top, exps=[0])
  cases["small_amax"] = (rc.random_input(rng, SQUARE, np.float32) * np.float32(1e-4)).astype(dtype)
  for name, x in cases.items():
    rc.check_against_oracle(x, q, label=name)
    rc.check_against_oracle(np.ascontiguousarray(x.T), q, label=name + ".T")


@pytest.mark.parametrize("shape", [(32, 256), (3, 5, 64), (0, 64), (128, 384)])
def test_current_scaling_shapes(shape):
  rng = np.random.default_rng(2)
  rc.check_against_oracle(rc.random_input(rng, shape, rc.DTYPES["bf16"]), Float8Quantizer("e4m3"))


def test_current_scaling_tiny_amax_and_eps():
  """Subnormal amaxes: the scale overflows to inf and becomes the dtype's max; a subnormal
  eps lifts a smaller subnormal amax; an eps above amax replaces it."""
  rng = np.random.default_rng(3)
  f32 = np.float32
  x = np.zeros(SQUARE, f32)
  for amax in (f32(1e-45), f32(3e-41), f32(2.0**-126), f32(1e-36), f32(448.0 / 3.4e38)):
    x[:] = 0
    x[5, 7] = -amax
    x[9, 1:20] = amax * rng.random(19).astype(f32)
    rc.check_against_oracle(x, Float8Quantizer("e4m3"), label=f"amax={amax}")
    rc.check_against_oracle(x, Float8Quantizer("e4m3", pow2_scales=True), label=f"amax={amax}")
  x[:] = 0
  x[0, 0] = f32(1e-42)
  sub_eps = Float8Quantizer("e4m3", eps=1e-40)  # eps > amax, both subnormal
  rc.check_against_oracle(x, sub_eps, label="subnormal eps")
  x[0, 0] = f32(2e-40)  # amax > eps, both subnormal
  rc.check_against_oracle(x, sub_eps, label="subnormal eps")
  bf = rc.subnormals(rng, SQUARE, rc.DTYPES["bf16"])
  rc.check_against_oracle(bf, Float8Quantizer("e4m3"), label="bf16 subnormal")


def test_current_scaling_value_for_inf_per_dtype():
  """fmax / amax overflows only for subnormal fp32/bf16 amaxes; the scale becomes the input
  dtype's largest finite value (checked directly, not only through the oracle)."""
  x = np.zeros((128, 128), np.float32)
  x[3, 3] = np.float32(1e-44)
  qt = rc.quantize_jit(jnp.asarray(x), Float8Quantizer("e4m3"), rc.USAGES)
  assert np.asarray(qt.rowwise.scale_inv) == np.float32(1) / np.finfo(np.float32).max
  xb = x.astype(rc.DTYPES["bf16"])
  xb[3, 3] = np.float32(2.0**-133)
  qt = rc.quantize_jit(jnp.asarray(xb), Float8Quantizer("e4m3"), rc.USAGES)
  assert np.asarray(qt.rowwise.scale_inv) == np.float32(1) / orc.dtype_max(rc.DTYPES["bf16"])


def test_current_scaling_nan_and_inf_codes():
  """Conventions: NaN data is the canonical positive NaN (E4M3 0x7F, E5M2 0x7E); +-inf
  saturates to +-fmax; amax inf or NaN gives scale 1."""
  x = np.ones((128, 128), np.float32)
  x[0, :4] = [np.nan, -np.nan, np.inf, -np.inf]
  for element, nan, fmax_code in (("e4m3", 0x7F, 0x7E), ("e5m2", 0x7E, 0x7B)):
    qt = rc.quantize_jit(jnp.asarray(x), Float8Quantizer(element), rc.USAGES)
    d = rc.data_bits(qt.rowwise)
    assert list(d[0, :4]) == [nan, nan, fmax_code, 0x80 | fmax_code]
    assert np.asarray(qt.rowwise.scale_inv) == 1.0
    assert np.array_equal(rc.data_bits(qt.columnwise), d.T)


# ---------------------------------------------------------------- delayed scaling

DELAYED = [
  (DelayedFloat8Quantizer("e4m3", history_len=4), "bf16"),
  (DelayedFloat8Quantizer("e5m2", history_len=3, margin=2, amax_algo="most_recent"), "fp32"),
]


@jax.jit
def _record(state, amax):
  return scaling.record_amax(state, amax)


@pytest.mark.parametrize("q,dt", DELAYED, ids=lambda v: str(v))
def test_delayed_scaling_steps(q, dt):
  """Several training steps: quantize with the stored scale (state in -> state out with this
  step's amax recorded), then the once-per-step update, all checked against the oracle."""
  rng = np.random.default_rng(4)
  dtype = rc.DTYPES[dt]
  update = jax.jit(scaling.update, static_argnums=1)
  state = scaling.init_state(q)
  assert np.all(np.asarray(state.amax_history) == 0) and state.amax_history.shape == (
    q.history_len,
  )
  assert np.asarray(state.scale) == 1.0
  hist, scale = np.zeros(q.history_len, np.float32), np.float32(1)
  steps = [rc.random_input(rng, SQUARE, dtype) for _ in range(3)]
  steps += [
    np.zeros(SQUARE, dtype),  # amax 0: the scale is kept
    rc.subnormals(rng, SQUARE, dtype),  # subnormal amax
    rc.random_input(rng, SQUARE, dtype) * np.asarray(64, dtype),
  ]
  nan_step = steps[0].copy()
  nan_step[1, 2] = np.nan
  inf_step = steps[1].copy()
  inf_step[3, 4] = -np.inf
  steps += [inf_step, steps[2], nan_step] + steps[:2] * 2
  for i, x in enumerate(steps):
    qt, new_state = rc.check_against_oracle(x, q, state=state, label=f"step {i}")
    want_hist = hist.copy()
    want_hist[0] = orc.amax(np.array([hist[0], orc.amax(orc.to_f32(x))], np.float32))
    rc.assert_bits_equal(
      rc.canon_f32_bits(new_state.amax_history),
      rc.canon_f32_bits(want_hist),
      f"step {i} recorded history",
    )
    rc.assert_bits_equal(
      rc.canon_f32_bits(new_state.scale),
      rc.canon_f32_bits(scale),
      f"step {i} scale unchanged by quantize",
    )
    hist, scale = orc.delayed_update(want_hist, scale, q.element, margin=q.margin, algo=q.amax_algo)
    state = update(new_state, q)
    rc.assert_bits_equal(
      rc.canon_f32_bits(state.amax_history), rc.canon_f32_bits(hist), f"step {i} updated history"
    )
    rc.assert_bits_equal(
      rc.canon_f32_bits(state.scale), rc.canon_f32_bits(scale), f"step {i} updated scale"
    )


def test_delayed_update_rule_by_hand():
  """The update rule on a hand-written history: max vs most_recent, margin, roll by -1 and
  zero slot 0 (so the just-recorded amax moves to the last slot)."""
  q = DelayedFloat8Quantizer("e4m3", history_len=4, margin=1)
  st = scaling.DelayedScalingState(jnp.array([2.0, 7.0, 0.5, 1.0], jnp.float32), jnp.float32(3.0))
  new = scaling.update(st, q)
  np.testing.assert_array_equal(np.asarray(new.amax_history), [0.0, 0.5, 1.0, 2.0])
  assert np.asarray(new.scale) == np.float32(np.float32(448 / np.float32(7)) / 2)
  recent = scaling.update(st, dataclasses.replace(q, amax_algo="most_recent", margin=0))
  assert np.asarray(recent.scale) == np.float32(448 / np.float32(2))
  zero = scaling.update(dataclasses.replace(st, amax_history=jnp.zeros(4)), q)
  assert np.asarray(zero.scale) == 3.0


@pytest.mark.parametrize("q", [q for q, _ in DELAYED], ids=str)
def test_delayed_update_of_stacked_states_is_each_states_update(q):
  """States stacked along leading axes ([2, 3, history_len], as a vectorized update of a
  group takes them) update each as the oracle updates it alone: zero, subnormal, inf and
  NaN amaxes among them."""
  rng = np.random.default_rng(6)
  hist = np.float32(rng.lognormal(0.0, 8.0, (2, 3, q.history_len)))
  hist[0, 0] = 0.0
  hist[0, 1, 0] = np.float32(1e-41)
  hist[1, 0, 1 % q.history_len] = np.inf
  hist[1, 2, 0] = np.nan
  scale = np.float32(rng.lognormal(0.0, 2.0, (2, 3)))
  new = jax.jit(scaling.update, static_argnums=1)(
    scaling.DelayedScalingState(jnp.asarray(hist), jnp.asarray(scale)), q
  )
  for i in np.ndindex(2, 3):
    want_hist, want_scale = orc.delayed_update(
      hist[i], scale[i], q.element, margin=q.margin, algo=q.amax_algo
    )
    rc.assert_bits_equal(
      rc.canon_f32_bits(new.amax_history[i]), rc.canon_f32_bits(want_hist), f"state {i} history"
    )
    rc.assert_bits_equal(
      rc.canon_f32_bits(new.scale[i]), rc.canon_f32_bits(want_scale), f"state {i} scale"
    )


def test_delayed_record_and_combine_take_the_max():
  """Micro-batches / devices combine by max (NaN propagating, subnormals exact)."""
  q = DelayedFloat8Quantizer("e4m3", history_len=3)
  st = scaling.init_state(q)
  for amaxes in ([1.0, 3.0, 2.0], [1e-40, 2e-41], [0.0, 1e-45], [5.0, np.nan, 1.0]):
    s = st
    for a in amaxes:
      s = _record(s, jnp.float32(a))
    want = orc.amax(np.array(amaxes, np.float32))
    rc.assert_bits_equal(rc.canon_f32_bits(s.amax_history[0]), rc.canon_f32_bits(want), f"{amaxes}")
    a = _record(st, jnp.float32(amaxes[0]))
    b = _record(st, jnp.float32(amaxes[1]))
    c = scaling.combine(a, b)
    want2 = orc.amax(np.array(amaxes[:2], np.float32))
    rc.assert_bits_equal(
      rc.canon_f32_bits(c.amax_history[0]), rc.canon_f32_bits(want2), f"combine {amaxes[:2]}"
    )


# ---------------------------------------------------------------- block FP8

BLOCK = [
  (BlockFloat8Quantizer("e4m3", "1x128"), "bf16"),
  (BlockFloat8Quantizer("e4m3", "1x128"), "fp16"),
  (BlockFloat8Quantizer("e4m3", "1x128"), "fp32"),
  (BlockFloat8Quantizer("e4m3", "128x128"), "bf16"),
  (BlockFloat8Quantizer("e5m2", "128x128"), "fp32"),
  (BlockFloat8Quantizer("e5m2", "1x128", pow2_scales=False, eps=1e-30), "fp32"),
]
BLOCK_SHAPE = (256, 256)


@pytest.mark.parametrize("q,dt", BLOCK, ids=lambda v: str(v))
def test_block_fp8_edge_cases(q, dt):
  rng = np.random.default_rng(5)
  dtype = rc.DTYPES[dt]
  top = float(orc.FMAX[q.element])
  cases = rc.edge_suite(rng, BLOCK_SHAPE, dtype, q.element, 128, top)
  for name, x in cases.items():
    rc.check_against_oracle(x, q, label=name)
    rc.check_against_oracle(np.ascontiguousarray(x.T), q, label=name + ".T")


@pytest.mark.parametrize("block", ["1x128", "128x128"])
@pytest.mark.parametrize("shape", [(200, 300), (3, 5, 64), (0, 130)])
def test_block_fp8_partial_edge_blocks(block, shape):
  """Dims that are not multiples of 128: edge blocks cover only the real elements."""
  rng = np.random.default_rng(6)
  q = BlockFloat8Quantizer("e4m3", block)
  x = rc.random_input(rng, shape, rc.DTYPES["bf16"])
  rc.check_against_oracle(x, q)
  if x.size:  # a tiny edge block next to large full blocks gets its own (larger) scale
    x2 = x.reshape(-1, shape[-1]).copy()
    x2[:, -1] = x2[:, -1] * np.asarray(2.0**-20, x2.dtype)
    x2[-1, :] = x2[-1, :] * np.asarray(2.0**-20, x2.dtype)
    qt = rc.check_against_oracle(x2.reshape(shape), q, label="tiny edge")
    assert qt.rowwise.scale_inv.shape == (
      -(-x2.shape[0] // (1 if block == "1x128" else 128)),
      -(-x2.shape[1] // 128),
    )


def test_block_fp8_128x128_usages_share_tile_scales():
  rng = np.random.default_rng(7)
  x = rc.random_input(rng, (200, 300), rc.DTYPES["bf16"])
  qt = rc.quantize_jit(jnp.asarray(x), BlockFloat8Quantizer("e4m3", "128x128"), rc.USAGES)
  np.testing.assert_array_equal(rc.scale_bits(qt.columnwise), rc.scale_bits(qt.rowwise).T)
  np.testing.assert_array_equal(rc.data_bits(qt.columnwise), rc.data_bits(qt.rowwise).T)
