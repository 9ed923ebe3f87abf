"""Delayed-scaling state: an explicit pytree the caller threads through training steps.

NUMERICS.md, "Delayed scaling": a quantize step uses the stored `scale` and records the
step's amax into `amax_history[0]`; `update` runs once per training step and turns the
history into the next scale. The numbers are the reference's (`jaxquant/reference/_scaling.py`),
with this project's two rules beside NUMERICS.md's (docs/numerics.md, "Delayed scaling"):
the history's max ignores non-finite entries, and no scale is ever inf, NaN or zero.
`update(..., finite=False)` hands back the state as a skipped step found it;
`recorded_amaxes_finite` tells a train step's finiteness check about an inf or NaN input
that the FP8 casts saturated; `update(..., outlier_factor=)` skips a finite outlier amax
(`outlier_skipped`).
"""

from jaxquant.reference._scaling import (
  DelayedScalingState,
  check_state,
  combine,
  fan_out,
  fold_grad_amax,
  history_amax,
  init_state,
  max_amax,
  next_scale,
  outlier_skipped,
  record_amax,
  record_grad_amax,
  recorded_amaxes_finite,
  scale_divisor,
  update,
  with_current_slot,
)

__all__ = [
  "DelayedScalingState",
  "check_state",
  "combine",
  "fan_out",
  "fold_grad_amax",
  "history_amax",
  "init_state",
  "max_amax",
  "next_scale",
  "outlier_skipped",
  "record_amax",
  "record_grad_amax",
  "recorded_amaxes_finite",
  "scale_divisor",
  "update",
  "with_current_slot",
]
