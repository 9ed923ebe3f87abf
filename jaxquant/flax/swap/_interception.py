"""Routes the contractions a model's code calls to a handler: the hook of the swap-in.

`jax.lax.dot_general`, `jax.numpy.einsum`, `jax.numpy.dot`, `jax.numpy.matmul` and the
`@` operator of JAX arrays and tracers (`_targets.contraction_targets()`) are what a
Flax module calls to contract two arrays; JAX offers no public hook on them. While a
`routing(handler)` context is open anywhere in the process, those entry points are
replaced by dispatchers. A dispatcher hands the call to the handler of the *current*
context (a contextvar, so other threads and code outside any context call the originals
unchanged) unless routing is paused (`jaxquant.flax._routing_pause`: a layer computing
its own GEMM); the handler runs with routing paused, so the contractions it makes
itself, and the originals it falls back to, are not routed again. When the last context
closes, JAX's classes and modules are left exactly as they were: an attribute the owner
held is put back, one it inherited is deleted again.

Threads: which handler runs, and whether routing is paused, is per thread (and task);
the patched entry points are the same for every thread and trace (the concrete array
class is found under `jax.ensure_compile_time_eval`, not in whatever trace the first
context opens in). See
`_Patched` for why opening, closing and dispatching need no more than one lock.

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
import dataclasses
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


def _dispatch(kind: str, original: Callable, args: tuple, kwargs: dict):
  handler = _HANDLER.get()
  if handler is None or routing_pause.is_paused():
    return original(*args, **kwargs)
  with routing_pause.paused():
    return handler(Call(kind, args, kwargs, original))


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


@dataclasses.dataclass(frozen=True)
class _Patch:
  """A dispatcher set on `owner.attribute`, and how to undo it: put back what `owner`
  held itself (`vars(owner)`), or delete the attribute it inherited."""

  owner: Any
  attribute: str
  owned: bool
  held: Any

  @classmethod
  def apply(cls, target: ContractionTarget) -> _Patch:
    namespace = vars(target.owner)
    patch = cls(
      target.owner,
      target.attribute,
      target.attribute in namespace,
      namespace.get(target.attribute),
    )
    original = getattr(target.owner, target.attribute)
    setattr(target.owner, target.attribute, _dispatcher(target, original))
    return patch

  def undo(self):
    if self.owned:
      setattr(self.owner, self.attribute, self.held)
    else:
      delattr(self.owner, self.attribute)


class _Patched:
  """The process-wide part of routing: how many contexts are open, in all threads, and
  the patches set while any is.

  Lock discipline. `open` and `close` count and patch under one lock, so the entry
  points are patched exactly while the count is positive: a thread opening while
  another's context is open only counts, and the last thread to close restores every
  entry point before another can open (which then patches anew, reading the restored
  originals). Dispatchers take no lock: each holds its original in its closure and reads
  only its own thread's contextvars. So a thread with no context of its own that fetched
  a dispatcher just before the last context closed (or calls one while a context opens)
  runs the original it holds, unchanged; a thread inside a context never sees its
  dispatchers removed, as its context keeps the count positive. A lock there would
  serialize every contraction of every thread. Setting or deleting a class or module
  attribute is atomic for the threads that read it. The targets are resolved before
  the lock is taken: the first resolution runs JAX, which takes locks of its own.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._contexts = 0
    self._patches: list[_Patch] = []

  def open(self):
    targets = contraction_targets()
    with self._lock:
      if self._contexts == 0:
        try:
          for target in targets:
            self._patches.append(_Patch.apply(target))
        except BaseException:
          self._undo()
          raise
      self._contexts += 1

  def close(self):
    with self._lock:
      self._contexts -= 1
      if self._contexts == 0:
        self._undo()

  def _undo(self):
    while self._patches:
      self._patches.pop().undo()


# Process-wide by nature: the entry points are attributes of JAX's modules and classes.
_PATCHED = _Patched()


@contextlib.contextmanager
def routing(handler: Handler):
  """Within this context (this thread / task), contractions go to `handler(call)`."""
  _PATCHED.open()
  try:
    token = _HANDLER.set(handler)
    try:
      with routing_pause.paused(False):
        yield
    finally:
      _HANDLER.reset(token)
  finally:
    _PATCHED.close()
