"""Whether the interception routes the contractions made now (`_interception`).

A quantized layer computes its own GEMM: under a swap-in (`jaxquant.flax.swap`) or a
quantized function (`jaxquant.functional`), which route every contraction, the layer
runs inside `paused()`, so its contractions are not routed a second time. The
dispatchers read `is_paused()`; a `routing` context opens with `paused(False)`, so what
runs inside it is routed again.
"""

from __future__ import annotations

import contextlib
import contextvars

_PAUSED: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jaxquant_routing_paused", default=False
)


@contextlib.contextmanager
def paused(value: bool = True):
  """Within this context (this thread / task), contractions run as written (True) or are
  routed by an open swap-in (False)."""
  token = _PAUSED.set(value)
  try:
    yield
  finally:
    _PAUSED.reset(token)


def is_paused() -> bool:
  return _PAUSED.get()
