"""Delayed scaling through jaxquant.dense: forward amaxes in new_state, the grad_output
amax as the cotangent of state["grad_output"], combined by max across uses."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant import scaling
from jaxquant.quantizers import DelayedFloat8Quantizer

M, K, N = 32, 48, 16
Q = {
  "input": DelayedFloat8Quantizer(history_len=4),
  "weight": DelayedFloat8Quantizer(history_len=4),
  "grad_output": DelayedFloat8Quantizer("e5m2", history_len=4),
}


def _init():
  return {t: scaling.init_state(q) for t, q in Q.items()}


def _arrays(seed):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(ks[0], (M, K)) * (1 + seed),
    jax.random.normal(ks[1], (K, N)),
    jax.random.normal(ks[2], (M, N)) * (3 + seed),
  )


def _amax(a):
  return float(jnp.max(jnp.abs(a)))


@jax.jit
def _two_threaded_calls(kernel, state, x1, dy1, x2, dy2):
  """Two uses of one layer (weight sharing), the state threaded through both."""

  def loss(kernel, state):
    y1, s1 = jq.dense(x1, kernel, quantizers=Q, state=state)
    y2, s2 = jq.dense(x2, kernel, quantizers=Q, state=s1)
    return jnp.sum(y1 * dy1) + jnp.sum(y2 * dy2), s2

  return jax.grad(loss, argnums=1, has_aux=True)(kernel, state)


def test_forward_amaxes_in_new_state_and_grad_amax_as_cotangent():
  x1, kernel, dy1 = _arrays(0)
  x2, _, dy2 = _arrays(1)
  state_grad, new_state = _two_threaded_calls(kernel, _init(), x1, dy1, x2, dy2)
  assert float(new_state["input"].amax_history[0]) == max(_amax(x1), _amax(x2))
  assert float(new_state["weight"].amax_history[0]) == _amax(kernel)
  np.testing.assert_array_equal(new_state["grad_output"].amax_history, 0)  # known in backward
  go = state_grad["grad_output"]
  assert float(go.amax_history[0]) == max(_amax(dy1), _amax(dy2))  # max, not the sum
  np.testing.assert_array_equal(go.amax_history[1:], 0)
  assert float(go.scale) == 0
  for t in ("input", "weight"):
    np.testing.assert_array_equal(state_grad[t].amax_history, 0)
  recorded = scaling.record_grad_amax(new_state["grad_output"], go)
  assert float(recorded.amax_history[0]) == max(_amax(dy1), _amax(dy2))
  updated = scaling.update(recorded, Q["grad_output"])
  assert float(updated.scale) == np.float32(57344.0) / np.float32(max(_amax(dy1), _amax(dy2)))


def test_fan_out_combines_parallel_uses_by_max():
  x1, kernel, dy1 = _arrays(0)
  x2, _, dy2 = _arrays(1)
  q = {"grad_output": Q["grad_output"]}

  def loss(go_state):
    a, b = scaling.fan_out(go_state, 2)
    y1, _ = jq.dense(x1, kernel, quantizers=q, state={"grad_output": a})
    y2, _ = jq.dense(x2, kernel, quantizers=q, state={"grad_output": b})
    return jnp.sum(y1 * dy1) + jnp.sum(y2 * dy2)

  g = jax.jit(jax.grad(loss))(scaling.init_state(Q["grad_output"]))
  assert float(g.amax_history[0]) == max(_amax(dy1), _amax(dy2))


def test_a_delayed_scaling_step_writes_its_history_slots_without_scatters():
  """Recording amaxes (forward and backward) and the update write slot 0 of each history by
  concatenation: a scatter would be a kernel of its own on GPUs, fused with nothing."""
  x1, kernel, dy1 = _arrays(0)
  x2, _, dy2 = _arrays(1)

  def step(kernel, state):
    state_grad, new_state = _two_threaded_calls(kernel, state, x1, dy1, x2, dy2)
    return {
      t: scaling.update(scaling.record_grad_amax(s, state_grad[t]), Q[t])
      for t, s in new_state.items()
    }

  hlo = jax.jit(step).lower(kernel, _init()).as_text()
  assert "scatter" not in hlo


def test_amaxes_fold_into_a_history_slot_without_reductions():
  """The max of the recorded and the observed amax is elementwise: a reduction would be a
  kernel of its own on GPUs, one per role recorded in forward and backward."""
  state, amax = _init()["input"], jnp.float32(3.0)
  for fold in (scaling.record_amax, scaling.fold_grad_amax):
    hlo = jax.jit(fold).lower(state, amax).as_text()
    assert "reduce" not in hlo, fold.__name__
  merged = jax.jit(scaling.combine).lower(state, state).as_text()
  assert "reduce" not in merged
