"""`quantize` / `dequantize`: the CUDA kernels where they run, the reference otherwise.

The implementation follows the backend choice (ops/_backend.py: per call `implementation=`,
else JAXQUANT_BACKEND, else "auto"; JAXQUANT_DISABLE_KERNELS):

- "auto": the kernels when `jaxquant.kernels.available()` and they take this quantizer
  and shape; the reference otherwise.
- "reference": always the pure-JAX reference (debugging, tests).
- "kernel": the kernel primitives (CUDA on GPUs, their reference lowering elsewhere);
  a quantizer or shape they do not take is an error.

Both produce the same bits (stochastic rounding: the same distribution).
"""

from __future__ import annotations

from typing import Optional

import jax

from jaxquant import kernels, reference
from jaxquant.ops._backend import Backend, read_backend
from jaxquant.quantizers import DelayedFloat8Quantizer, Quantizer, for_usage, needs_key
from jaxquant.scaling import DelayedScalingState, record_amax
from jaxquant.tensor import QuantizedTensor, Usage, check_usages


def quantize(
  x: jax.Array,
  quantizer: Quantizer,
  usages=("rowwise", "columnwise"),
  *,
  key: Optional[jax.Array] = None,
  state: Optional[DelayedScalingState] = None,
  implementation: Optional[str] = None,
):
  """Same contract as `jaxquant.reference.quantize`, dispatched to the kernels."""
  return quantize_with(read_backend(implementation), x, quantizer, usages, key=key, state=state)


def quantize_with(
  backend: Backend,
  x: jax.Array,
  quantizer: Quantizer,
  usages=("rowwise", "columnwise"),
  *,
  key: Optional[jax.Array] = None,
  state: Optional[DelayedScalingState] = None,
):
  """`quantize` under a backend choice already read. An empty tensor is the reference's: no
  kernel is launched on it."""
  if not backend.binds("quantize_usages") or 0 in x.shape:
    return reference.quantize(x, quantizer, usages, key=key, state=state)
  reference.check_input(x, quantizer)
  usages = check_usages(usages)
  reference.check_delayed_state(quantizer, state)
  if any(needs_key(for_usage(quantizer, u)) for u in usages) and key is None:
    raise ValueError(f"{quantizer!r} rounds stochastically: pass a PRNG key as key=")
  shape = tuple(x.shape)
  x2d = x.reshape(-1, shape[-1])
  slots, new_state = {}, state
  for base, group in cast_groups(quantizer, usages):
    if base is None:
      for usage in group:
        slots["hp_" + usage] = x2d if usage == "rowwise" else x2d.T
      continue
    reason = kernels.unsupported_reason(base, *x2d.shape, x2d.dtype)
    if reason and backend.choice == "auto":
      qt = reference.quantize(x, base, group, key=key, state=state)
      if isinstance(base, DelayedFloat8Quantizer):
        qt, new_state = qt
      slots.update({u: qt.usage(u) for u in group})
      continue
    scale = state.scale if isinstance(base, DelayedFloat8Quantizer) else None
    usage_data, amax = kernels.quantize_usages_and_amax(x2d, base, group, key=key, scale=scale)
    slots.update(usage_data)
    if isinstance(base, DelayedFloat8Quantizer):
      new_state = record_amax(state, amax)
  qt = QuantizedTensor(shape=shape, dtype=x.dtype, **slots)
  return (qt, new_state) if state is not None else qt


def cast_groups(quantizer: Quantizer, usages: tuple[Usage, ...]):
  """(base quantizer, usages it produces): one kernel pass per distinct base quantizer."""
  bases = [(for_usage(quantizer, u), u) for u in usages]
  if len(bases) == 2 and bases[0][0] == bases[1][0]:
    return [(bases[0][0], usages)]
  return [(q, (u,)) for q, u in bases]


def dequantize(
  qt: QuantizedTensor, usage: Usage = "rowwise", dtype=None, *, implementation: Optional[str] = None
) -> jax.Array:
  """Same contract as `jaxquant.reference.dequantize`."""
  backend = read_backend(implementation)
  stored = qt.usage(usage)
  if (
    not backend.binds("dequantize_data")
    or stored is None
    or not hasattr(stored, "format")
    or 0 in stored.stored_shape
  ):
    return reference.dequantize(qt, usage, dtype)
  dtype = dtype or qt.dtype
  rows, cols = stored.stored_shape
  if cols % 16 and backend.choice == "auto":
    return reference.dequantize(qt, usage, dtype)
  matrix = kernels.dequantize_data(stored, dtype)
  if usage == "columnwise":
    matrix = matrix.T
  return matrix.reshape(qt.shape)
