"""Delayed scaling's update under faults: tiny and huge amaxes, inf and NaN in the history,
margins at their limits, a skipped step (`finite=False`), against a numpy oracle of
docs/numerics.md's rule written here (NUMERICS.md's update, its history max over the
finite entries, its scale clamped into [2^-126, FLT_MAX], a NaN scale as 1)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import scaling
from jaxquant.quantizers import DelayedFloat8Quantizer
from jaxquant.reference import _scaling

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
MIN_NORMAL = F32(2.0**-126)
FMAX = {"e4m3": F32(448.0), "e5m2": F32(57344.0)}


def oracle_update(hist, scale, q: DelayedFloat8Quantizer, finite=True):
  """The update in numpy float32 (IEEE, subnormals kept): (history, scale) after it."""
  hist, scale = np.array(hist, F32), F32(scale)
  if not finite:  # the step's records dropped, nothing else moves
    hist[..., 0] = 0
    return hist, scale
  if q.amax_algo == "max":
    a = F32(np.max(np.where(np.isfinite(hist), np.abs(hist), F32(0)), initial=F32(0)))
  else:
    a = hist[0]
  with np.errstate(all="ignore"):
    new = F32(F32(FMAX[q.element] / a) / F32(2.0**q.margin))
  if a == 0 or not np.isfinite(a):
    new = scale
  if np.isnan(new):
    new = F32(1)
  elif new > FLT_MAX:
    new = F32(FLT_MAX)
  elif not new >= MIN_NORMAL:
    new = MIN_NORMAL
  hist = np.roll(hist, -1)
  hist[0] = 0
  return hist, new


def bits(v) -> np.ndarray:
  return np.atleast_1d(np.asarray(v, F32)).view(np.uint32)


def assert_update(q, hist, scale, *, finite=True, update=None, what=""):
  update = update or jax.jit(scaling.update, static_argnums=1)
  state = scaling.DelayedScalingState(jnp.asarray(hist, jnp.float32), jnp.float32(scale))
  got = update(state, q) if finite is True else update(state, q, finite=finite)
  want_hist, want_scale = oracle_update(hist, scale, q, finite=bool(finite))
  assert np.array_equal(bits(got.amax_history), bits(want_hist)), (
    f"{what}: history {np.asarray(got.amax_history)} != {want_hist}"
  )
  assert np.array_equal(bits(got.scale), bits(want_scale)), (
    f"{what}: scale {float(got.scale)!r} != {float(want_scale)!r}"
  )
  return got


E4M3 = DelayedFloat8Quantizer("e4m3", history_len=4)
E5M2 = DelayedFloat8Quantizer("e5m2", history_len=4)


@pytest.mark.parametrize("q", [E4M3, E5M2, dataclasses.replace(E4M3, amax_algo="most_recent")])
@pytest.mark.parametrize("amax", [1e-37, 1e-35, 1e-40, 1e-45], ids=lambda a: f"{a:g}")
def test_a_tiny_amax_gives_the_largest_finite_scale(q, amax):
  """fmax / amax overflows below fmax / FLT_MAX (1.3e-36 E4M3, 1.7e-34 E5M2; subnormal
  amaxes included): the scale is FLT_MAX, never inf, and the next quantization of a zero
  stays finite."""
  got = assert_update(q, [amax, 0, 0, 0], 2.0, what=f"amax {amax}")
  with np.errstate(over="ignore"):
    overflows = F32(FMAX[q.element] / F32(amax)) == np.inf
  assert (float(got.scale) == FLT_MAX) == overflows
  assert np.isfinite(float(got.scale)) and float(got.scale) > 0
  assert np.isfinite(np.float32(0) * np.asarray(got.scale))  # 0 * inf was the NaN


@pytest.mark.parametrize(
  "margin,amax",
  [(40, 1e38), (127, 1.0), (10, 3e38), (127, FLT_MAX), (0, FLT_MAX), (-149, 1.0), (-149, 1e38)],
)
def test_margins_at_their_limits_give_finite_nonzero_scales(margin, amax):
  """A huge amax over a large 2^margin gives 0 or a subnormal (the smallest normal,
  2^-126, instead: its reciprocal is finite and nothing flushes it); a negative margin
  overflows an ordinary amax's scale (FLT_MAX instead)."""
  q = DelayedFloat8Quantizer("e4m3", history_len=3, margin=margin)
  got = assert_update(q, [amax, 1.0, 0.5], 3.0, what=f"margin {margin}, amax {amax}")
  assert MIN_NORMAL <= float(got.scale) <= FLT_MAX
  assert np.isfinite(F32(1) / np.asarray(got.scale))  # the stored scale_inv


@pytest.mark.parametrize("bad", [np.inf, np.nan, -np.nan], ids=["inf", "nan", "-nan"])
@pytest.mark.parametrize("slot", [0, 2])
def test_the_history_max_ignores_non_finite_entries(bad, slot):
  """One inf or NaN in the history no longer keeps the old scale for history_len steps:
  the max runs over the finite entries (subnormal ones exact)."""
  q = DelayedFloat8Quantizer("e4m3", history_len=4, margin=1)
  hist = np.array([2.0, 7.0, 1e-41, 0.5], F32)
  hist[slot] = bad
  got = assert_update(q, hist, 3.0, what=f"{bad} at {slot}")
  assert float(got.scale) == F32(F32(448 / F32(7.0)) / 2)
  tiny = np.array([bad, 1e-41, 0, 3e-42], F32)  # only subnormals beside the fault
  got = assert_update(q, tiny, 3.0, what=f"{bad} beside subnormals")
  assert float(got.scale) == FLT_MAX


@pytest.mark.parametrize("q", [E4M3, dataclasses.replace(E5M2, amax_algo="most_recent")], ids=str)
def test_a_history_without_finite_nonzero_entries_keeps_the_scale(q):
  for hist in ([np.nan, np.inf, 0, 0], [0, 0, 0, 0], [np.inf, np.nan, np.inf, np.nan]):
    got = assert_update(q, hist, 5.0, what=str(hist))
    assert float(got.scale) == 5.0


@pytest.mark.parametrize(
  "q",
  [E4M3, DelayedFloat8Quantizer("e5m2", history_len=3, margin=2, amax_algo="most_recent")],
  ids=str,
)
def test_ordinary_histories_keep_numerics_md_bits(q):
  """Finite histories whose scales stay in range: NUMERICS.md's bits, unchanged (the
  oracle here and the plain rule agree on every one)."""
  rng = np.random.default_rng(11)
  hist = F32(rng.lognormal(0.0, 8.0, (64, q.history_len)))
  hist[::7, 0] = 0
  hist[3, :] = 0
  hist[5, 1] = F32(1e-41)
  scale = F32(rng.lognormal(0.0, 2.0, 64))
  new = jax.jit(scaling.update, static_argnums=1)(
    scaling.DelayedScalingState(jnp.asarray(hist), jnp.asarray(scale)), q
  )
  for i in range(64):
    a = hist[i].max() if q.amax_algo == "max" else hist[i, 0]
    plain = scale[i] if a == 0 else F32(F32(FMAX[q.element] / a) / F32(2.0**q.margin))
    want_hist, want_scale = oracle_update(hist[i], scale[i], q)
    assert bits(want_scale) == bits(plain), i  # in range: the clamp leaves it
    assert bits(new.scale[i]) == bits(want_scale), i
    assert np.array_equal(bits(new.amax_history[i]), bits(want_hist)), i


@pytest.mark.parametrize("q", [E4M3, dataclasses.replace(E5M2, margin=3)], ids=str)
def test_a_skipped_step_hands_the_state_back_under_jit(q):
  """finite=False (Python or traced): the step's record dropped, history and scale as
  they were, no roll; a traced True is the plain update, bit for bit."""
  update = jax.jit(lambda s, finite: scaling.update(s, q, finite=finite))
  hist = np.array([np.nan, 7.0, 1e-41, 0.5], F32)
  for finite in (False, np.bool_(False), jnp.bool_(False)):
    got = assert_update(q, hist, 3.0, finite=finite, what=f"finite={finite!r}")
    assert np.array_equal(bits(got.amax_history[1:]), bits(hist[1:]))
  traced = lambda s, _q, finite: update(s, finite)
  assert_update(q, hist, 3.0, finite=jnp.bool_(False), update=traced, what="traced False")
  on = assert_update(q, hist, 3.0, finite=jnp.bool_(True), update=traced, what="traced True")
  plain = scaling.update(scaling.DelayedScalingState(jnp.asarray(hist), jnp.float32(3.0)), q)
  assert np.array_equal(bits(on.scale), bits(plain.scale))
  assert np.array_equal(bits(on.amax_history), bits(plain.amax_history))


def test_a_skipped_step_of_stacked_states_hands_each_back():
  q = E4M3
  hist = np.float32(np.random.default_rng(3).lognormal(0.0, 4.0, (2, 3, q.history_len)))
  hist[1, 2, 0] = np.inf
  scale = np.full((2, 3), 9.0, F32)
  state = scaling.DelayedScalingState(jnp.asarray(hist), jnp.asarray(scale))
  for finite in (True, False):
    new = jax.jit(lambda s, f: scaling.update(s, q, finite=f))(state, jnp.bool_(finite))
    for i in np.ndindex(2, 3):
      want_hist, want_scale = oracle_update(hist[i], scale[i], q, finite=finite)
      assert np.array_equal(bits(new.amax_history[i]), bits(want_hist)), (finite, i)
      assert bits(new.scale[i]) == bits(want_scale), (finite, i)


def test_finite_must_be_a_bool_scalar():
  state = scaling.init_state(E4M3)
  for bad in (jnp.ones((2,), bool), jnp.float32(1.0)):
    with pytest.raises(ValueError, match="finite: a bool scalar"):
      scaling.update(state, E4M3, finite=bad)


@pytest.mark.parametrize(
  "returned,want",
  [(np.inf, FLT_MAX), (0.0, MIN_NORMAL), (1e-40, MIN_NORMAL), (-2.0, MIN_NORMAL), (np.nan, 1.0)],
)
def test_the_clamp_applies_to_whatever_next_scale_of_returns(returned, want):
  """The clamp is `update`'s, after `next_scale_of` (the kernel's division or the
  reference's): each returns `next_scale`'s bits, unclamped."""
  returns = lambda amax, scale, fmax, divisor: jnp.full_like(scale, returned)
  state = scaling.DelayedScalingState(jnp.asarray([1.0, 2.0, 0.0, 0.0]), jnp.float32(5.0))
  got = jax.jit(lambda s: scaling.update(s, E4M3, next_scale_of=returns))(state)
  assert bits(got.scale) == bits(want)
  assert bits(_scaling.clamp_scale(jnp.float32(returned))) == bits(want)


def test_next_scale_itself_is_unclamped():
  """`next_scale` (which `kernels.delayed_scale` matches bit for bit) keeps NUMERICS.md's
  formula: its inf is `update`'s to clamp."""
  got = scaling.next_scale(jnp.float32(1e-37), jnp.float32(2.0), 448.0, 1.0)
  assert float(got) == np.inf


def test_recorded_amaxes_finite_reads_the_current_slot():
  check = jax.jit(scaling.recorded_amaxes_finite)
  hist = np.zeros((2, 4), F32)
  hist[:, 1] = np.nan  # older entries are not this step's
  hist[0, 0] = 3e38
  assert bool(check(scaling.DelayedScalingState(jnp.asarray(hist), jnp.ones(2))))
  for bad in (np.inf, np.nan):
    hist[1, 0] = bad
    assert not bool(check(scaling.DelayedScalingState(jnp.asarray(hist), jnp.ones(2))))


OUTLIER_FACTOR = 2.0**10


@pytest.mark.parametrize("q", [E4M3, dataclasses.replace(E4M3, amax_algo="most_recent")])
def test_an_outlier_is_skipped_for_one_step_then_a_lasting_one_recorded(q):
  """`outlier_factor`: an amax more than the factor above the history's max is not recorded
  (the scale as if slot 0 were empty), and rolls in as its negative, which the max ignores;
  the next step records whatever comes, so an amax that stays high is the new range."""
  update = jax.jit(lambda s: scaling.update(s, q, outlier_factor=OUTLIER_FACTOR))
  state = scaling.DelayedScalingState(jnp.asarray([1e15, 3.0, 2.0, 0.0], F32), F32(149.0))
  assert bool(scaling.outlier_skipped(state, OUTLIER_FACTOR))
  skipped = update(state)
  want_hist, want_scale = oracle_update([0.0, 3.0, 2.0, 0.0], 149.0, q)
  want_hist[-1] = -1e15
  assert np.array_equal(bits(skipped.amax_history), bits(want_hist)), skipped.amax_history
  assert np.array_equal(bits(skipped.scale), bits(want_scale))
  again = dataclasses.replace(skipped, amax_history=skipped.amax_history.at[0].set(1e15))
  assert not bool(scaling.outlier_skipped(again, OUTLIER_FACTOR))
  recorded = update(again)
  assert float(recorded.scale) == np.float32(448.0) / np.float32(1e15)
  assert float(recorded.amax_history[-1]) == np.float32(1e15)


def test_no_outlier_leaves_the_update_s_bits_unchanged():
  """Within the factor (and with nothing yet to compare with) the guarded update is the
  plain one, bit for bit."""
  for hist in ([1000.0, 3.0, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]):
    state = scaling.DelayedScalingState(jnp.asarray(hist, F32), F32(2.0))
    guarded = scaling.update(state, E4M3, outlier_factor=OUTLIER_FACTOR)
    plain = scaling.update(state, E4M3)
    for a, b in zip(jax.tree.leaves(guarded), jax.tree.leaves(plain), strict=True):
      assert np.array_equal(bits(a), bits(b)), hist


@pytest.mark.parametrize("factor", [1.0, 0.5, float("inf"), float("nan"), "10"])
def test_the_outlier_factor_must_be_a_number_above_one(factor):
  state = scaling.init_state(E4M3)
  with pytest.raises(ValueError, match=f"outlier_factor must be a finite number > 1.*{factor}"):
    scaling.update(state, E4M3, outlier_factor=factor)
