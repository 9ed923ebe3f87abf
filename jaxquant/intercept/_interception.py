"""Routes the contractions a program calls to a handler: the hook of the interception.

`jax.lax.dot_general`, `jax.lax.ragged_dot`, `jax.lax.ragged_dot_general`,
`jax.numpy.einsum`, `jax.numpy.dot`, `jax.numpy.matmul` and the `@` operator of JAX
arrays and tracers (`_targets.contraction_targets()`) are what a model's code calls to
contract two arrays; JAX offers no public hook on them. While a `routing(handler)`
context is open anywhere in the process, they dispatch: a call goes to the handler of
the *current* context (a contextvar, so other threads and code outside any context call
the originals unchanged) unless routing is paused (`jaxquant.intercept._routing_pause`: a
layer computing its own GEMM); the handler runs with routing paused, so the
contractions it makes itself, and the originals it falls back to, are not routed again.
When the last context closes, JAX's functions, classes and modules are left exactly as
they were.

Two ways to dispatch, by what the entry point is:

- A plain Python function (`dot_general`, `ragged_dot`, `ragged_dot_general`, `einsum`
  on JAX 0.10 to 0.12) is redirected in place (`_Redirect`): the function object keeps
  its identity, only its code is swapped for a trampoline into the dispatcher (and its
  original code and defaults run as a copy). So `einsum is jnp.einsum` stays true for a
  function bound before routing began (MaxText passes `precision=` only then), and a
  name bound before routing began (`from jax.numpy import einsum`, a module attribute)
  is routed too. Calls that JAX's own modules make (`_runs_as_written`) run as written, as
  they did when only the public names were replaced: `jnp.einsum`, the jnp products and
  the transpose rules call `dot_general` directly, `ragged_dot` calls
  `ragged_dot_general`, and a trace JAX caches inside its own jitted functions never
  holds a routed call. So does a JAX transformation applied to the function itself
  (`jax.vmap(jnp.einsum)` calls it from JAX's module).
- A compiled jitted function (`jnp.dot` and `jnp.matmul` are `PjitFunction`s) and an
  operator are replaced by a dispatcher on their owner (`_Patch`): `jnp.dot` seen while
  routing is not the `jnp.dot` bound before, and a name bound before routing began
  reaches the original: the swap report (`_report`) shows what was found.

Threads: which handler runs, and whether routing is paused, is per thread (and task);
the patched entry points are the same for every thread and trace (the concrete array
class is found under `jax.ensure_compile_time_eval`, not in whatever trace the first
context opens in). See `_Patched` for why opening, closing and dispatching need no more
than one lock.

Why the entry points and not `lax.dot_general` alone: `jnp.dot`, `jnp.matmul` and
`jnp.einsum` are jitted inside, and a jitted function reuses its cached trace, so a hook
below them would miss every call whose trace is already cached, and would see the
operands as the inner trace's tracers, not as the model's params.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import sys
import threading
import types
from typing import Any, Callable, Optional

from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept._calls import Call
from jaxquant.intercept._targets import ContractionTarget, contraction_targets, transform_targets

Handler = Callable[[Call], Any]
Handlers = contextvars.ContextVar[Optional[Handler]]
_HANDLER: Handlers = contextvars.ContextVar("jaxquant_contraction_handler", default=None)
# The handler of `lax.scan` and `jax.checkpoint` calls (`_targets.transform_targets()`), for
# an integration that threads what it keeps per call through them (`jaxquant.functional`).
_TRANSFORM_HANDLER: Handlers = contextvars.ContextVar("jaxquant_transform_handler", default=None)


def _dispatch(kind: str, original: Callable, args: tuple, kwargs: dict, handlers: Handlers):
  handler = handlers.get()
  if handler is None or routing_pause.is_paused():
    return original(*args, **kwargs)
  with routing_pause.paused():
    return handler(Call(kind, args, kwargs, original))


def _dispatcher(target: ContractionTarget, original: Callable, handlers: Handlers) -> Callable:
  """What replaces `target` while routing: a function's or an operator's dispatcher."""
  kind = target.kind
  if target.operator is None:

    def dispatcher(*args, **kwargs):
      if _runs_as_written(sys._getframe(1)):
        return original(*args, **kwargs)
      return _dispatch(kind, original, args, kwargs, handlers)
  elif target.operator == "right":  # `b @ a`: the call holds (b, a), the product order

    def dispatcher(self, other):
      if _runs_as_written(sys._getframe(1)):
        return original(self, other)
      return _dispatch(kind, lambda a, b: original(b, a), (other, self), {}, handlers)
  else:

    def dispatcher(self, other):
      if _runs_as_written(sys._getframe(1)):
        return original(self, other)
      return _dispatch(kind, original, (self, other), {}, handlers)

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
  def apply(cls, target: ContractionTarget, handlers: Handlers = _HANDLER) -> _Patch:
    namespace = vars(target.owner)
    patch = cls(
      target.owner,
      target.attribute,
      target.attribute in namespace,
      namespace.get(target.attribute),
    )
    original = getattr(target.owner, target.attribute)
    setattr(target.owner, target.attribute, _dispatcher(target, original, handlers))
    return patch

  def undo(self):
    if self.owned:
      setattr(self.owner, self.attribute, self.held)
    else:
      delattr(self.owner, self.attribute)


# The dispatcher's keyword in the redirected function's keyword defaults.
_ROUTE = "_jaxquant_route"


def _trampoline(*args, _jaxquant_route, **kwargs):
  # Runs as the code of a JAX function, in that function's module globals: it reads
  # nothing but its arguments, and has no closure (the function it replaces has none).
  return _jaxquant_route(args, kwargs)


# jaxquant's own GEMM code: the quantized GEMMs the handler runs (with routing paused),
# whose backward JAX may trace while the model's call still runs, routing on (a
# custom_vjp's backward partially evaluated with an inner `jax.jit` / `nnx.jit` under a
# gradient). Never a model's contraction.
_JAXQUANT_GEMM_CODE = ("jaxquant.ops", "jaxquant.reference", "jaxquant.kernels")


def _runs_as_written(frame) -> bool:
  """Whether a contraction called from `frame` runs as written: JAX's own modules and
  jaxquant's GEMM code call no model contraction."""
  module = frame.f_globals.get("__name__", "") if frame is not None else ""
  return module.partition(".")[0] in ("jax", "jaxlib") or module.startswith(_JAXQUANT_GEMM_CODE)


def _copy(function: types.FunctionType) -> types.FunctionType:
  """A new function object running `function`'s code with its globals and defaults."""
  copy = types.FunctionType(
    function.__code__,
    function.__globals__,
    function.__name__,
    function.__defaults__,
    function.__closure__,
  )
  copy.__kwdefaults__ = dict(function.__kwdefaults__ or {})
  copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
  return copy


def _router(kind: str, original: Callable, handlers: Handlers) -> Callable:
  def route(args, kwargs):
    # Frame 0: route, 1: the trampoline, 2: whoever called the JAX function.
    if handlers.get() is None or _runs_as_written(sys._getframe(2)):
      return original(*args, **kwargs)
    return _dispatch(kind, original, args, kwargs, handlers)

  return route


def redirects_in_place(target: ContractionTarget) -> bool:
  """A function target that is a plain Python function (not a compiled jitted one) with
  no closure (the trampoline has none) and no signature of its own to keep: else it is
  replaced on its owner."""
  function = getattr(target.owner, target.attribute)
  return (
    target.operator is None
    and isinstance(function, types.FunctionType)
    and not function.__closure__
    and "__signature__" not in vars(function)
  )


@dataclasses.dataclass(frozen=True)
class _Redirect:
  """A plain function whose code is swapped for the trampoline into its dispatcher, and
  how to undo it. The keyword defaults are widened before the code is swapped and
  narrowed after it is put back, so that a call in another thread meanwhile finds the
  defaults its code needs (extra keyword defaults are ignored). `inspect.signature`
  keeps reading the original's (`__signature__`, deleted again on undo)."""

  function: types.FunctionType
  code: types.CodeType
  kwdefaults: Optional[dict]

  @classmethod
  def apply(cls, target: ContractionTarget, handlers: Handlers = _HANDLER) -> _Redirect:
    function = getattr(target.owner, target.attribute)
    redirect = cls(function, function.__code__, function.__kwdefaults__)
    route = _router(target.kind, _copy(function), handlers)
    function.__signature__ = inspect.signature(function)
    function.__kwdefaults__ = {**(redirect.kwdefaults or {}), _ROUTE: route}
    function.__code__ = _trampoline.__code__
    return redirect

  def undo(self):
    self.function.__code__ = self.code
    self.function.__kwdefaults__ = self.kwdefaults
    del self.function.__signature__


def _apply(target: ContractionTarget, handlers: Handlers):
  return (_Redirect if redirects_in_place(target) else _Patch).apply(target, handlers)


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
  attribute, and setting a function's code or keyword defaults, is atomic for the
  threads that read it (`_Redirect` orders its two settings). The targets are resolved before
  the lock is taken: the first resolution runs JAX, which takes locks of its own.
  """

  def __init__(self, targets: Callable[[], tuple[ContractionTarget, ...]], handlers: Handlers):
    self._targets = targets
    self._handlers = handlers
    self._lock = threading.Lock()
    self._contexts = 0
    self._patches: list = []  # _Patch and _Redirect

  def open(self):
    targets = self._targets()
    with self._lock:
      if self._contexts == 0:
        try:
          for target in targets:
            self._patches.append(_apply(target, self._handlers))
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
_PATCHED = _Patched(contraction_targets, _HANDLER)
_PATCHED_TRANSFORMS = _Patched(transform_targets, _TRANSFORM_HANDLER)


@contextlib.contextmanager
def _handled(patched: _Patched, handlers: Handlers, handler: Handler):
  patched.open()
  try:
    token = handlers.set(handler)
    try:
      yield
    finally:
      handlers.reset(token)
  finally:
    patched.close()


@contextlib.contextmanager
def routing(handler: Handler, transform_handler: Optional[Handler] = None):
  """Within this context (this thread / task), contractions go to `handler(call)`, and
  with a `transform_handler`, `lax.scan` and `jax.checkpoint` calls to
  `transform_handler(call)` (a `Call` of kind "scan" or "checkpoint", its arguments as the
  transformation takes them)."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(_handled(_PATCHED, _HANDLER, handler))
    if transform_handler is not None:
      stack.enter_context(_handled(_PATCHED_TRANSFORMS, _TRANSFORM_HANDLER, transform_handler))
    with routing_pause.paused(False):
      yield
