"""Delayed-scaling state: an explicit pytree the caller threads through training steps.

NUMERICS.md, "Delayed scaling": a quantize step uses the stored `scale` and records the
step's amax into `amax_history[0]`; `update` runs once per training step and turns the
history into the next scale. The numbers are the reference's (`jaxquant/reference/_scaling.py`).
"""

from jaxquant.reference._scaling import (
  DelayedScalingState,
  combine,
  fan_out,
  fold_grad_amax,
  history_amax,
  init_state,
  max_amax,
  next_scale,
  record_amax,
  record_grad_amax,
  scale_divisor,
  update,
  with_current_slot,
)

__all__ = [
  "DelayedScalingState",
  "combine",
  "fan_out",
  "fold_grad_amax",
  "history_amax",
  "init_state",
  "max_amax",
  "next_scale",
  "record_amax",
  "record_grad_amax",
  "scale_divisor",
  "update",
  "with_current_slot",
]
