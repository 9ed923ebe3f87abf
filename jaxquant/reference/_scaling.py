"""Delayed-scaling state: an explicit pytree the caller threads through training steps.

NUMERICS.md, "Delayed scaling": a quantize step uses the stored `scale` and records the
step's amax into `amax_history[0]` (by max, so several micro-batches, branches or
devices combine correctly); `update` runs once per training step and turns the history
into the next scale. Two rules of this project beside NUMERICS.md's (docs/numerics.md,
"Delayed scaling"), so that one faulty step never locks a state into inf or NaN: the
history's max ignores its non-finite entries, and every scale `update` returns is
clamped into fp32's normal range; `update(..., finite=False)` drops a skipped step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.quantizers import DelayedFloat8Quantizer
from jaxquant.reference import _fp32 as fp32

_MIN_NORMAL_BITS = np.uint32(0x00800000)
_INF_BITS = np.uint32(0x7F800000)
_SIGN_BIT = np.uint32(0x80000000)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
  amax_history: jax.Array  # fp32 [history_len]; [0] is the step being recorded
  scale: jax.Array  # fp32 (), multiplies the tensor before the FP8 cast


def init_state(quantizer: DelayedFloat8Quantizer) -> DelayedScalingState:
  return DelayedScalingState(
    jnp.zeros((quantizer.history_len,), jnp.float32), jnp.ones((), jnp.float32)
  )


def check_state(state) -> None:
  """Raises, naming the value and the rule, where `state` cannot be one tensor's
  delayed-scaling state: not a DelayedScalingState (e.g. a checkpoint restored without a
  target), a history that is not an fp32 vector or a scale that is not an fp32 scalar
  (either would broadcast into a wrong result), or a concrete scale that is not a finite
  positive number (every quantized value would be NaN, 0 or inf). A traced scale is
  checked by shape only; `update` never makes a scale that fails this."""
  if not isinstance(state, DelayedScalingState):
    raise TypeError(
      f"delayed scaling needs a DelayedScalingState, got {type(state).__name__}: restore "
      "checkpoints with the model's state as target"
    )
  history, scale = state.amax_history, state.scale
  if jnp.ndim(history) != 1 or jnp.size(history) == 0 or jnp.result_type(history) != jnp.float32:
    raise ValueError(
      "DelayedScalingState.amax_history must be a non-empty float32 vector [history_len] "
      f"(one tensor's), got {jnp.result_type(history)} of shape {tuple(jnp.shape(history))}"
    )
  if tuple(jnp.shape(scale)) != () or jnp.result_type(scale) != jnp.float32:
    raise ValueError(
      "DelayedScalingState.scale must be a float32 scalar, got "
      f"{jnp.result_type(scale)} of shape {tuple(jnp.shape(scale))}"
    )
  if not isinstance(scale, jax.core.Tracer):
    value = float(np.asarray(scale))
    if not (math.isfinite(value) and value > 0):
      raise ValueError(
        f"DelayedScalingState.scale must be finite and > 0, got {value} (every quantized "
        "value would be 0, inf or NaN)"
      )


def max_amax(a, b) -> jax.Array:
  """Elementwise max of amaxes (>= 0 or NaN), NaN propagating and exact on subnormals.

  Not jnp.maximum: XLA:CPU flushes subnormal operands of max to zero; amaxes are >= 0,
  so the max of their magnitudes is their max.
  """
  return fp32.abs_maximum(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))


def with_current_slot(history: jax.Array, value) -> jax.Array:
  """`history` ([..., history_len]) with slot 0 of its last axis replaced by `value`.

  A concatenation, not `history.at[..., 0].set(value)`: JAX lowers that to a scatter,
  which XLA:GPU runs as a kernel of its own and fuses with nothing, and a delayed-scaling
  step writes a slot for every role it records, in forward, in backward and in `update`.
  """
  value = jnp.broadcast_to(jnp.asarray(value, history.dtype), history.shape[:-1])
  return jnp.concatenate([value[..., None], history[..., 1:]], axis=-1)


def record_amax(state: DelayedScalingState, amax: jax.Array) -> DelayedScalingState:
  """Folds an observed amax into the current history slot (max, NaN propagating); with
  leading axes ([..., history_len], one history per group), one amax per history."""
  hist = with_current_slot(state.amax_history, max_amax(state.amax_history[..., 0], amax))
  return dataclasses.replace(state, amax_history=hist)


def combine(a: DelayedScalingState, b: DelayedScalingState) -> DelayedScalingState:
  """Merges two records of the same step (micro-batches, devices): max, never overwrite."""
  return DelayedScalingState(max_amax(a.amax_history, b.amax_history), a.scale)


def scale_divisor(quantizer: DelayedFloat8Quantizer) -> float:
  """2^margin, the new scale being fmax / amax / 2^margin (exact in fp32 for a margin in
  [-149, 127])."""
  return math.ldexp(1.0, quantizer.margin)


def next_scale(amax: jax.Array, scale: jax.Array, fmax: float, divisor: float) -> jax.Array:
  """The scale after a step whose history's amax is `amax` (elementwise): fmax / amax /
  divisor, in exact fp32 divisions; the old `scale` where amax is zero or not finite."""
  new_scale = fp32.div(jnp.float32(fmax), amax)
  # x / 1 is x, bit for bit; skipping it keeps one exact division (an integer emulation on
  # GPUs) out of the step.
  if divisor != 1.0:
    new_scale = fp32.div(new_scale, jnp.float32(divisor))
  keep = fp32.is_zero(amax) | ~fp32.is_finite(amax)
  return jnp.where(keep, scale, new_scale)


def is_skipped_outlier(hist: jax.Array) -> jax.Array:
  """Which history entries are outliers `update(..., outlier_factor=)` skipped: kept as
  their negatives (every recorded amax is >= 0), which the history's max ignores."""
  return (fp32.bits(hist) > _SIGN_BIT) & fp32.is_finite(hist)


def finite_max(hist: jax.Array, axis=-1) -> jax.Array:
  """The max of the finite entries of an amax history (>= 0; 0 where none is finite),
  exact on subnormals, skipped outliers left out. A NaN or inf recorded on one faulty step
  would otherwise rule the max, and so keep the old scale, for as many steps as the history
  is long (TransformerEngine's fmaxf reduction ignores NaN too)."""
  kept = fp32.is_finite(hist) & ~is_skipped_outlier(hist)
  # A select moves bits and flushes nothing; abs_max compares magnitude bits.
  return fp32.abs_max(jnp.where(kept, hist, jnp.zeros_like(hist)), axis=axis)


def check_outlier_factor(factor) -> None:
  if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
    raise ValueError(f"outlier_factor must be a finite number > 1 (or None), got {factor!r}")


def outlier_skipped(state: DelayedScalingState, factor: float) -> jax.Array:
  """Whether `update(..., outlier_factor=factor)` skips the amax recorded this step
  (`amax_history[..., 0]`; per group with leading axes): finite, more than `factor` times
  the max of the history's earlier entries (compared in fp32; never while that max is 0,
  nothing to compare with), and the step before not skipped itself: an amax that stays
  that high for a second step is the tensor's new range, and is recorded."""
  check_outlier_factor(factor)
  hist = state.amax_history
  current, earlier = hist[..., 0], finite_max(hist[..., 1:])
  return (
    fp32.is_finite(current)
    & ~fp32.is_zero(earlier)
    & (current > earlier * jnp.float32(factor))
    & ~is_skipped_outlier(hist[..., -1])
  )


def history_amax(state: DelayedScalingState, quantizer: DelayedFloat8Quantizer) -> jax.Array:
  """The amax the next scale is computed from: the max of the history's finite entries,
  or its current slot (which `next_scale` ignores where it is not finite)."""
  hist = state.amax_history
  if quantizer.amax_algo == "max":
    return finite_max(hist, axis=-1)
  return hist[..., 0]


SMALLEST_SCALE = 2.0**-126  # fp32's smallest normal: its reciprocal, the scale_inv, is 2^126
LARGEST_SCALE = float(np.finfo(np.float32).max)  # FLT_MAX


def clamp_scale(scale: jax.Array) -> jax.Array:
  """`scale` clamped into fp32's normal range [2^-126, FLT_MAX], a NaN as 1.

  fmax / amax overflows to inf for an amax below fmax / FLT_MAX (1.3e-36 for E4M3): an
  inf scale would make the next quantization compute 0 * inf = NaN; TransformerEngine
  clamps it to FLT_MAX. Divided by a large 2^margin, a huge finite amax gives 0 (or a
  subnormal): a zero scale has an infinite reciprocal, and GPUs and XLA:CPU flush
  subnormal operands to zero; the smallest normal is the nearest scale that neither
  overflows its reciprocal nor gets flushed. A NaN scale comes only from a corrupted
  state the caller handed in; 1 is current scaling's scale for an amax it cannot use.
  Compared as bits, so that no backend flushes the subnormals being clamped.
  """
  u = fp32.bits(scale)
  normal = (u >= _MIN_NORMAL_BITS) & (u < _INF_BITS)  # positive, normal, finite
  clamped = jnp.where(
    u == _INF_BITS, jnp.float32(LARGEST_SCALE), jnp.float32(SMALLEST_SCALE)
  )  # +inf; 0, subnormal or negative
  clamped = jnp.where(fp32.is_nan(scale), jnp.float32(1.0), clamped)
  return jnp.where(normal, scale.astype(jnp.float32), clamped)


def update(
  state: DelayedScalingState,
  quantizer: DelayedFloat8Quantizer,
  next_scale_of=next_scale,
  *,
  finite=True,
  outlier_factor=None,
) -> DelayedScalingState:
  """The once-per-step update: new scale from the history, then roll and clear slot 0;
  with leading axes ([..., history_len], one history per group), per group.

  `next_scale_of` computes the new scales (`next_scale`'s signature and bits):
  `kernels.delayed_scale` runs its exact divisions as CUDA instructions instead of XLA's
  integer emulation (`ops.delayed_state.update` chooses). Whatever it returns is clamped
  (`clamp_scale`), so no scale is ever inf, NaN or zero.

  `finite` (a bool or a traced bool scalar) says whether the step is kept: where it is
  False (a step the optimizer skipped), the state comes back as the step found it: slot
  0's records dropped (cleared, as the previous update left it), the rest of the history
  and the scale unchanged, nothing rolled.

  `outlier_factor` (None: off; else a number > 1) guards against a finite outlier, such as
  a batch scaled by 1e15 whose loss stays finite: an amax `outlier_skipped` flags is not
  recorded for this step (the scale is computed as if slot 0 held nothing), and it rolls
  into the history as its negative, which the history's max ignores and which lets the
  next step record whatever comes. Unguarded, such an amax rules the history's max, and
  shrinks the scale so that every ordinary value underflows, for `history_len` steps."""
  hist = recorded = state.amax_history
  if outlier_factor is not None:
    skipped = outlier_skipped(state, outlier_factor)
    current = hist[..., 0]
    hist = with_current_slot(hist, jnp.where(skipped, jnp.float32(0.0), current))
    recorded = with_current_slot(hist, jnp.where(skipped, fp32.neg(current), current))
  scale = next_scale_of(
    history_amax(DelayedScalingState(hist, state.scale), quantizer),
    state.scale,
    float(quantizer.format("rowwise").fmax),
    scale_divisor(quantizer),
  )
  rolled = with_current_slot(jnp.roll(recorded, -1, axis=-1), 0.0)
  new = DelayedScalingState(rolled, clamp_scale(scale))
  if finite is True:  # the common call: no selects in the step
    return new
  unchanged = DelayedScalingState(with_current_slot(state.amax_history, 0.0), state.scale)
  if finite is False:
    return unchanged
  keep = jnp.asarray(finite)
  if keep.shape != () or keep.dtype != jnp.bool_:
    raise ValueError(f"finite: a bool scalar, got {keep.dtype}{list(keep.shape)}")
  return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, unchanged)


def recorded_amaxes_finite(state: DelayedScalingState) -> jax.Array:
  """Whether every amax recorded into the current slot (`amax_history[..., 0]`) is
  finite: a bool scalar. An inf input never reaches a loss through an FP8 cast, which
  saturates it to +-fmax, but its amax is recorded here; a train step's finiteness check
  can take this into account beside the loss's and the gradients'."""
  return jnp.all(fp32.is_finite(state.amax_history[..., 0]))


# ---- grad_output amaxes: known only in backward, returned as a state cotangent. ----
#
# An op that quantizes grad_output with delayed scaling returns its amax as the cotangent
# of `state["grad_output"]`: `amax_history` carries it in slot 0, every other entry and
# `scale` carry zeros (or what came in from later uses, see `fold_grad_amax`). When the
# state is threaded (each op's returned new_state feeds the next op), each op folds the
# cotangent arriving from later uses into its own by max, so N uses combine by max.
# JAX itself adds cotangents when one state *value* fans out to several ops: those
# combine by sum (an upper bound of the max); thread the state, or `fan_out` it.


def fold_grad_amax(cotangent: DelayedScalingState, amax: jax.Array) -> DelayedScalingState:
  """A state cotangent with `amax` folded into slot 0 by max (NaN propagating)."""
  hist = cotangent.amax_history
  return DelayedScalingState(with_current_slot(hist, max_amax(hist[0], amax)), cotangent.scale)


def record_grad_amax(
  state: DelayedScalingState, state_grad: DelayedScalingState
) -> DelayedScalingState:
  """Records the grad_output amax carried by `state_grad` (the gradient of the loss
  with respect to `state`) into `state`, by max. Call before `update`."""
  return record_amax(state, state_grad.amax_history[0])


def fan_out(state: DelayedScalingState, n: int) -> tuple[DelayedScalingState, ...]:
  """`n` copies of `state` for `n` ops that use it side by side (not threaded): their
  grad_output amax cotangents then combine by max instead of JAX's sum."""

  @jax.custom_vjp
  def copies(s):
    return (s,) * n

  def bwd(_, cts):
    hist = cts[0].amax_history
    for ct in cts[1:]:
      hist = max_amax(hist, ct.amax_history)
    return (DelayedScalingState(hist, sum(ct.scale for ct in cts)),)

  copies.defvjp(lambda s: (copies(s), None), bwd)
  return copies(state)
