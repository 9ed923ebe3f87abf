"""Delayed-scaling state of the Linen swap-in: per-step update, scan + remat, gradient
accumulation, and an orbax checkpoint round trip."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tiny_transformers as tt

import jaxquant.flax as jqf
from jaxquant import recipes, scaling
from jaxquant.intercept._role_state import _delayed
from jaxquant.quantizers import DelayedFloat8Quantizer
from jaxquant.roles import QuantizerRole

ROLES = ("input", "weight", "grad_output")


def _role_states(collections):
  return jax.tree.leaves(collections, is_leaf=jqf.is_role_state)


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_scanned_remat_state_is_per_layer_and_advances_once_per_step():
  windows = tt.batch()
  model = jqf.quantize_model(tt.ScannedLinenLM(), recipes.fp8_delayed)
  params, collections = tt.linen_init(model, windows)
  scanned = collections["quant_state"]["layers"]["block"]["mlp"]["wi"]
  assert set(scanned) == set(ROLES)
  assert scanned["input"].scaling.amax_history.shape == (tt.LAYERS, 1024)
  assert scanned["input"].role.name == "layers/block/mlp/wi"
  _, (_, _, collections) = tt.train_linen(model, params, collections, 2, windows)
  scanned = _role_states(collections["quant_state"]["layers"])
  assert len(scanned) == 3 * len(tt.BLOCK_GEMMS)  # three roles each
  for state in scanned:
    hist = state.scaling.amax_history
    # Two updates: the two recorded amaxes rolled to the end, slot 0 cleared, per layer.
    assert np.all(hist[:, -2:] > 0) and np.all(hist[:, :-2] == 0), state.role
    assert np.all(state.scaling.scale != 1.0), state.role  # grad_output's included
    if state.role.tensor_type != "weight":  # (truncated-normal kernels share their amax)
      assert not np.array_equal(hist[0], hist[1]), state.role


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_gradient_accumulation_combines_by_max():
  big, small = tt.batch(1), tt.batch(2)
  model = jqf.quantize_model(tt.LinenLM(), recipes.fp8_delayed)
  params, collections = tt.linen_init(model, big)

  @jax.jit
  def records(windows, scale):
    def loss_fn(params, collections):
      logits, updated = model.apply(
        {"params": params, **collections}, windows[:, :-1], mutable=["quant_state"]
      )
      return scale * tt.xent(logits, windows), updated

    (_, updated), (_, state_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      params, collections
    )
    return updated, state_grads

  a, b = records(big, 1.0), records(small, 3.0)
  forward = jqf.combine_quant_state(a[0], b[0])
  grads = jqf.combine_quant_state(a[1], b[1])
  for s, sa, sb in zip(*map(_role_states, (forward, a[0], b[0])), strict=False):
    np.testing.assert_array_equal(
      s.scaling.amax_history, np.maximum(sa.scaling.amax_history, sb.scaling.amax_history)
    )
  for g, ga, gb in zip(*map(_role_states, (grads, a[1], b[1])), strict=False):
    if g.role.tensor_type == "grad_output":
      assert (
        g.scaling.amax_history[0] == max(ga.scaling.amax_history[0], gb.scaling.amax_history[0]) > 0
      )
  advanced = jqf.update_quant_state(forward, grads)
  for s in _role_states(advanced):
    assert s.scaling.amax_history[-1] > 0 and s.scaling.amax_history[0] == 0


@pytest.mark.slow
def test_orbax_round_trip_then_identical_next_step(tmp_path):
  windows = tt.batch()
  model = jqf.quantize_model(tt.LinenLM(), recipes.fp8_delayed)
  params, collections = tt.linen_init(model, windows)
  _, train_state = tt.train_linen(model, params, collections, 2, windows)

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", train_state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, train_state)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)

  assert jax.tree.structure(restored) == jax.tree.structure(train_state)
  jax.tree.map(np.testing.assert_array_equal, restored, train_state)
  step = tt.jitted_linen_step(model)  # compiled already by train_linen above
  after = step(*train_state, windows, jax.random.key(7))
  after_restored = step(*restored, windows, jax.random.key(7))
  jax.tree.map(np.testing.assert_array_equal, after_restored, after)
  assert any(s.scaling.scale != 1.0 for s in _role_states(after[2]))


def _per_role_update(state, grad):
  """The update of one role alone: scaling's own functions, layer by layer."""
  s = state.scaling
  for layer in np.ndindex(*s.amax_history.shape[:-1]):
    one = scaling.DelayedScalingState(s.amax_history[layer], s.scale[layer])
    if grad is not None and state.role.tensor_type == "grad_output":
      one = scaling.record_grad_amax(
        one,
        scaling.DelayedScalingState(grad.scaling.amax_history[layer], grad.scaling.scale[layer]),
      )
    one = scaling.update(one, _delayed(state.quantizer))
    s = scaling.DelayedScalingState(
      s.amax_history.at[layer].set(one.amax_history), s.scale.at[layer].set(one.scale)
    )
  return s


def _mixed_states():
  """(states, their gradients): quantizers of other margins and history lengths, scanned
  and single layers, grad_output amaxes, amaxes that are subnormal, zero, inf or NaN."""
  rng = np.random.default_rng(5)
  quantizers = [
    DelayedFloat8Quantizer(),
    DelayedFloat8Quantizer(margin=2, history_len=16),
    DelayedFloat8Quantizer("e5m2", history_len=16, amax_algo="most_recent"),
  ]
  special = np.array([1e-40, 0.0, np.inf, np.nan, 3e-39, 448.0], np.float32)
  tree, grads = {}, {}
  for i, q in enumerate(quantizers):
    for layers in ((), (3,)):
      for t in ROLES:
        shape = layers + (q.history_len,)
        hist = rng.uniform(0, 10, shape).astype(np.float32)
        hist.flat[rng.integers(0, hist.size, 4)] = rng.choice(special, 4)
        scale = rng.uniform(0.5, 2, layers).astype(np.float32)
        role = QuantizerRole("linear", t, f"m{i}{len(layers)}")
        state = jqf.RoleState(
          scaling.DelayedScalingState(jnp.asarray(hist), jnp.asarray(scale)), role, q
        )
        grad_hist = np.zeros(shape, np.float32)
        grad_hist[..., 0] = rng.choice(np.concatenate([special, [7.0, 0.25]]), layers)
        grad = dataclasses.replace(
          state,
          scaling=scaling.DelayedScalingState(
            jnp.asarray(grad_hist), jnp.zeros(layers, jnp.float32)
          ),
        )
        key = f"m{i}_{len(layers)}_{t}"
        tree[key], grads[key] = state, grad
  tree["not_a_state"] = jnp.ones(2)
  grads["not_a_state"] = jnp.zeros(2)
  return tree, grads


def test_update_advances_each_role_as_it_would_alone():
  """The update runs once per group of like states; every role must still get the bits of
  its own update (`_mixed_states`)."""
  tree, grads = _mixed_states()
  for with_grads in (True, False):
    got = jax.jit(jqf.update_quant_state)(tree, grads if with_grads else None)
    assert got["not_a_state"] is not None
    for key, state in tree.items():
      if key == "not_a_state":
        continue
      want = _per_role_update(state, grads[key] if with_grads else None)
      bits = lambda a: np.asarray(a).view(np.uint32)
      np.testing.assert_array_equal(
        bits(got[key].scaling.amax_history), bits(want.amax_history), key
      )
      np.testing.assert_array_equal(bits(got[key].scaling.scale), bits(want.scale), key)
      assert got[key].role == state.role and got[key].quantizer == state.quantizer


def test_a_skipped_step_hands_every_state_back_under_jit():
  """finite=False (traced): every role, grouped, scanned or single, comes back as the step
  found it (slot 0's records dropped, nothing rolled, the scale kept); a traced True is
  the plain update, bit for bit."""
  tree, grads = _mixed_states()
  step = jax.jit(lambda t, g, f: jqf.update_quant_state(t, g, finite=f))
  bits = lambda a: np.asarray(a).view(np.uint32)
  skipped = step(tree, grads, jnp.bool_(False))
  kept = step(tree, grads, jnp.bool_(True))
  plain = jax.jit(jqf.update_quant_state)(tree, grads)
  for key, state in tree.items():
    if key == "not_a_state":
      continue
    hist = np.array(state.scaling.amax_history)
    hist[..., 0] = 0
    np.testing.assert_array_equal(bits(skipped[key].scaling.amax_history), bits(hist), key)
    np.testing.assert_array_equal(bits(skipped[key].scaling.scale), bits(state.scaling.scale))
    for a, b in zip(jax.tree.leaves(kept[key]), jax.tree.leaves(plain[key]), strict=True):
      np.testing.assert_array_equal(bits(a), bits(b), key)
    assert np.all(np.isfinite(kept[key].scaling.scale)), key
    assert np.all(np.asarray(kept[key].scaling.scale) > 0), key


def test_recorded_amaxes_finite_reads_forward_records_and_grad_output_amaxes():
  tree, grads = _mixed_states()
  check = jax.jit(jqf.recorded_amaxes_finite)
  finite = lambda states: jax.tree.map(
    lambda s: dataclasses.replace(
      s,
      scaling=scaling.DelayedScalingState(
        jnp.nan_to_num(s.scaling.amax_history, nan=1.0, posinf=2.0), s.scaling.scale
      ),
    ),
    {k: v for k, v in states.items() if k != "not_a_state"},
    is_leaf=jqf.is_role_state,
  )
  clean, clean_grads = finite(tree), finite(grads)
  assert bool(check(clean, clean_grads)) and bool(check(clean, None))
  assert not bool(check(tree, None))  # inf / NaN among the forward records
  for role in ROLES:
    for bad in (np.inf, np.nan):
      g = dict(clean_grads)
      key = f"m0_1_{role}"
      g[key] = dataclasses.replace(
        g[key],
        scaling=scaling.DelayedScalingState(
          g[key].scaling.amax_history.at[1, 0].set(bad), g[key].scaling.scale
        ),
      )
      # Only grad_output's gradient carries an amax; the others' are not records.
      assert bool(check(clean, g)) == (role != "grad_output"), (role, bad)


def test_state_restored_without_a_target_is_refused_with_how_to_restore(tmp_path):
  """A checkpoint restored with no target gives plain dicts: the helpers found no RoleState
  in them and did nothing (an inf amax read as finite, no update). They refuse it, saying
  how to restore with a target; restored with one, the state works again."""
  tree, grads = _mixed_states()  # forward records with inf and NaN amaxes among them
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    untyped = checkpointer.restore(tmp_path / "ckpt")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    typed = checkpointer.restore(tmp_path / "ckpt", abstract)
  assert isinstance(untyped["m0_0_input"], dict)  # what a restore without a target gives
  how = r"\['m0_0_\w+'\]\['scaling'\]\['amax_history'\] .*restored without a target.*target"
  with pytest.raises(TypeError, match="recorded_amaxes_finite: " + how):
    jqf.recorded_amaxes_finite(untyped)
  with pytest.raises(TypeError, match="update_quant_state: " + how):
    jqf.update_quant_state(untyped)
  with pytest.raises(TypeError, match=r"update_quant_state \(its state_grads\): "):
    jqf.update_quant_state(tree, {**untyped, "not_a_state": grads["not_a_state"]})
  with pytest.raises(TypeError, match="combine_quant_state: " + how):
    jqf.combine_quant_state(untyped, untyped)
  assert not bool(jqf.recorded_amaxes_finite(typed))
