"""Routes the contractions a model's code calls to a handler: the hook of the swap-in.

`jax.lax.dot_general`, `jax.numpy.einsum`, `jax.numpy.dot`, `jax.numpy.matmul` and the
`@` operator of JAX arrays and tracers are what a Flax module calls to contract two
arrays; JAX offers no public hook on them. While a `routing(handler)` context is open
anywhere in the process, those entry points are replaced by dispatchers. A dispatcher
hands the call to the handler of the *current* context (a contextvar, so other threads
and code outside any context call the originals unchanged); the handler runs with
routing paused, so the contractions it makes itself, and the originals it falls back
to, are not routed again. The entry points are restored when the last context closes.

Why the entry points and not `lax.dot_general` alone: `jnp.dot`, `jnp.matmul` and
`jnp.einsum` are jitted, and a jitted function reuses its cached trace, so a hook below
them would miss every call whose trace is already cached.

Calls through a name bound before routing began (`from jax.numpy import einsum` at
import, a function stored as a default argument or attribute) reach the originals: the
swap report (`jaxquant.flax.report`) shows what was found.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Call:
  """One routed contraction: `kind` in ("dot_general", "einsum", "dot", "matmul").

  For "matmul" (also `a @ b`) `args` is (a, b) in mathematical order.
  """

  kind: str
  args: tuple
  kwargs: dict
  original: Callable[..., Any]

  def fallback(self):
    """The call as the model's code made it (never routed again)."""
    return self.original(*self.args, **self.kwargs)


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
  if handler is None:
    return call.fallback()
  token = _HANDLER.set(None)
  try:
    return handler(call)
  finally:
    _HANDLER.reset(token)


def _function_dispatcher(kind: str, original: Callable) -> Callable:
  @functools.wraps(original)
  def dispatcher(*args, **kwargs):
    return _dispatch(kind, original, args, kwargs)

  return dispatcher


def _operator_dispatcher(original: Callable, reflected: bool) -> Callable:
  """`a @ b` (`__matmul__`) or `b @ a` (`__rmatmul__`, reflected) as a "matmul" call."""
  if reflected:

    def dispatcher(self, other):
      return _dispatch("matmul", lambda a, b: original(b, a), (other, self), {})
  else:

    def dispatcher(self, other):
      return _dispatch("matmul", original, (self, other), {})

  return functools.wraps(original)(dispatcher)


def _targets():
  """(owner, attribute, make_dispatcher) for every entry point."""
  array_type = type(jnp.zeros(()))
  functions = [
    (jax.lax, "dot_general", "dot_general"),
    (jnp, "einsum", "einsum"),
    (jnp, "dot", "dot"),
    (jnp, "matmul", "matmul"),
  ]
  out = [
    (owner, attr, functools.partial(_function_dispatcher, kind)) for owner, attr, kind in functions
  ]
  for cls in (jax.core.Tracer, array_type):
    out.append((cls, "__matmul__", functools.partial(_operator_dispatcher, reflected=False)))
    out.append((cls, "__rmatmul__", functools.partial(_operator_dispatcher, reflected=True)))
  return out


def _install():
  with _LOCK:
    if _OPEN["contexts"] == 0:
      for owner, attr, make in _targets():
        original = getattr(owner, attr)
        _OPEN["originals"][(owner, attr)] = original
        setattr(owner, attr, make(original))
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
    yield
  finally:
    _HANDLER.reset(token)
    _uninstall()


@contextlib.contextmanager
def paused():
  """Within this context, contractions run as written (e.g. a stock layer's own code)."""
  token = _HANDLER.set(None)
  try:
    yield
  finally:
    _HANDLER.reset(token)
