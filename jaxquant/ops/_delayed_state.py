"""The delayed-scaling update a train step runs: `scaling.update`, its exact divisions in
the CUDA kernel where the kernels run (`kernels.delayed_scale`: the same bits, without
the integer emulation XLA code needs), in the reference's XLA code otherwise. The choice
is the backend's (ops/_backend.py: JAXQUANT_BACKEND, else "auto"; the kernel's name
`delayed_scale` in JAXQUANT_DISABLE_KERNELS)."""

from __future__ import annotations

from typing import Optional

from jaxquant import kernels, scaling
from jaxquant.ops._backend import read_backend
from jaxquant.quantizers import DelayedFloat8Quantizer


def _kernel_next_scale(amax, scale, fmax: float, divisor: float):
  # The kernel takes a vector: states stacked along several leading axes go in flattened.
  return kernels.delayed_scale(amax.reshape(-1), scale.reshape(-1), fmax, divisor).reshape(
    scale.shape
  )


def divides_in_kernel(implementation: Optional[str] = None) -> bool:
  """Whether `update` divides in the kernel under the backend choice now."""
  return read_backend(implementation).binds("delayed_scale")


def update(
  state: scaling.DelayedScalingState,
  quantizer: DelayedFloat8Quantizer,
  implementation: Optional[str] = None,
  *,
  finite=True,
  outlier_factor=None,
) -> scaling.DelayedScalingState:
  """`scaling.update(state, quantizer, finite=finite, outlier_factor=outlier_factor)`, bit
  for bit; leading axes are groups of states."""
  options = dict(finite=finite, outlier_factor=outlier_factor)
  if not divides_in_kernel(implementation):
    return scaling.update(state, quantizer, **options)
  return scaling.update(state, quantizer, next_scale_of=_kernel_next_scale, **options)
