"""Delayed-scaling state: an explicit pytree the caller threads through training steps.

NUMERICS.md, "Delayed scaling": a quantize step uses the stored `scale` and records the
step's amax into `amax_history[0]` (by max, so several micro-batches, branches or
devices combine correctly); `update` runs once per training step and turns the history
into the next scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxquant.quantizers import DelayedFloat8Quantizer
from jaxquant.reference import fp32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
  amax_history: jax.Array  # fp32 [history_len]; [0] is the step being recorded
  scale: jax.Array  # fp32 (), multiplies the tensor before the FP8 cast


def init_state(quantizer: DelayedFloat8Quantizer) -> DelayedScalingState:
  return DelayedScalingState(jnp.zeros((quantizer.history_len,), jnp.float32),
                             jnp.ones((), jnp.float32))


def record_amax(state: DelayedScalingState, amax: jax.Array) -> DelayedScalingState:
  """Folds an observed amax into the current history slot (max, NaN propagating)."""
  hist = state.amax_history.at[0].set(jnp.maximum(state.amax_history[0], amax))
  return dataclasses.replace(state, amax_history=hist)


def combine(a: DelayedScalingState, b: DelayedScalingState) -> DelayedScalingState:
  """Merges two records of the same step (micro-batches, devices): max, never overwrite."""
  return DelayedScalingState(jnp.maximum(a.amax_history, b.amax_history),
                             a.scale)


def update(state: DelayedScalingState, quantizer: DelayedFloat8Quantizer) -> DelayedScalingState:
  """The once-per-step update: new scale from the history, then roll and clear slot 0."""
  hist = state.amax_history
  a = jnp.max(hist) if quantizer.amax_algo == "max" else hist[0]
  fmax = jnp.float32(quantizer.format("rowwise").fmax)
  new_scale = fp32.div(fp32.div(fmax, a), fp32.exp2(jnp.int32(quantizer.margin)))
  keep = fp32.is_zero(a) | ~fp32.is_finite(a)
  scale = jnp.where(keep, state.scale, new_scale)
  hist = jnp.roll(hist, -1).at[0].set(0.0)
  return DelayedScalingState(hist, scale)
