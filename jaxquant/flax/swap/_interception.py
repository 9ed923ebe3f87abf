"""Routes the contractions a model's code calls to a handler: the hook of the swap-in.

`jax.lax.dot_general`, `jax.numpy.einsum`, `jax.numpy.dot`, `jax.numpy.matmul` and the
`@` operator of JAX arrays and tracers (`_targets.contraction_targets()`) are what a
Flax module calls to contract two arrays; JAX offers no public hook on them. While a
`routing(handler)` context is open anywhere in the process, those entry points are
replaced by dispatchers. A dispatcher hands the call to the handler of the *current*
context (a contextvar, so other threads and code outside any context call the originals
unchanged) unless routing is paused (`jaxquant.flax._routing_pause`: a layer computing
its own GEMM); the handler runs with routing paused, so the contractions it makes
itself, and the originals it falls back to, are not routed again. The entry points are
restored when the last context closes.

Why the entry points and not `lax.dot_general` alone: `jnp.dot`, `jnp.matmul` and
`jnp.einsum` are jitted, and a jitted function reuses its cached trace, so a hook below
them would miss every call whose trace is already cached.

Calls through a name bound before routing began (`from jax.numpy import einsum` at
import, a function stored as a default argument or attribute) reach the originals: the
swap report (`_report`) shows what was found.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Any, Callable, Optional

from jaxquant.flax import _routing_pause as routing_pause
from jaxquant.flax.swap._calls import Call
from jaxquant.flax.swap._targets import ContractionTarget, contraction_targets

Handler = Callable[[Call], Any]
_HANDLER: contextvars.ContextVar[Optional[Handler]] = contextvars.ContextVar(
  "jaxquant_contraction_handler", default=None
)

# What is patched while any context is open (process-wide by nature: these are module
# and class attributes). Guarded by _LOCK.
_LOCK = threading.Lock()
_OPEN = {"contexts": 0, "originals": {}}


def _dispatch(kind: str, original: Callable, args: tuple, kwargs: dict):
  handler = _HANDLER.get()
  call = Call(kind, args, kwargs, original)
  if handler is None or routing_pause.is_paused():
    return call.fallback()
  with routing_pause.paused():
    return handler(call)


def _dispatcher(target: ContractionTarget, original: Callable) -> Callable:
  """What replaces `target` while routing: a function's or an operator's dispatcher."""
  kind = target.kind
  if target.operator is None:

    def dispatcher(*args, **kwargs):
      return _dispatch(kind, original, args, kwargs)
  elif target.operator == "right":  # `b @ a`: the call holds (b, a), the product order

    def dispatcher(self, other):
      return _dispatch(kind, lambda a, b: original(b, a), (other, self), {})
  else:

    def dispatcher(self, other):
      return _dispatch(kind, original, (self, other), {})

  return functools.wraps(original)(dispatcher)


def _install():
  with _LOCK:
    if _OPEN["contexts"] == 0:
      for target in contraction_targets():
        original = getattr(target.owner, target.attribute)
        _OPEN["originals"][(target.owner, target.attribute)] = original
        setattr(target.owner, target.attribute, _dispatcher(target, original))
    _OPEN["contexts"] += 1


def _uninstall():
  with _LOCK:
    _OPEN["contexts"] -= 1
    if _OPEN["contexts"] == 0:
      for (owner, attr), original in _OPEN["originals"].items():
        setattr(owner, attr, original)
      _OPEN["originals"].clear()


@contextlib.contextmanager
def routing(handler: Handler):
  """Within this context (this thread / task), contractions go to `handler(call)`."""
  _install()
  token = _HANDLER.set(handler)
  try:
    with routing_pause.paused(False):
      yield
  finally:
    _HANDLER.reset(token)
    _uninstall()
