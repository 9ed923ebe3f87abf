"""A weight GEMM under `jax.vmap`: the examples that share the weight are one GEMM.

Code written for one example (an Equinox layer: `weight @ x`, `x` a vector) and batched
with `jax.vmap` contracts each example on its own: a GEMM of one row, whose quantization
would scale each example by its own amax and whose blocks along the rows (MXFP8's and
NVFP4's columnwise usages) no single row fills. So where one operand is a weight and the
other is batched by a vmap that leaves the weight unbatched, the contraction is handed
to the vmap as a `jax.custom_batching.custom_vmap` function whose batching rule
contracts the whole batch at once: the batch axis becomes one more free axis of the
activation (more rows of the GEMM, as a batched model's), and the handler runs that
contraction (a vmap nested in another folds again, outermost last). The numbers are
then those of the same model written for a batch. Where the weight is batched too (an
ensemble vmapped over its params) each example keeps its own GEMM.

A `lax.scan` under such a vmap (an Equinox model for one example, its layers scanned)
would trace its body for one example, where nothing is batched: so a scan whose params
the vmap leaves unbatched runs as one scan over the whole batch, its body vmapped
(`handle_scan`; vmap and scan commute), and the body's GEMMs fold as above. What the
integration threads through the scan then stays in the scan's trace. A `jax.checkpoint`
under such a vmap likewise checkpoints the vmapped function (`checkpoint`).
"""

from __future__ import annotations

import inspect
import string
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxquant.intercept import _calls as calls
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._calls import Call

Handler = Callable[[Call], Any]


def _batching_trace(value: Any) -> Any:
  """The vmap trace batching `value` along an axis (a batching tracer's), else None.

  JAX has no public query for it: a batching tracer's `batch_dim` (None where the value
  is not batched) and `_trace` are fields that JAX 0.10 to 0.12 share (`_provenance`
  reads its tracers' fields alike); where they are missing, nothing is batched and each
  example keeps its own GEMM."""
  if isinstance(value, jax.core.Tracer) and getattr(value, "batch_dim", None) is not None:
    return getattr(value, "_trace", None)
  return None


def handle(call: Call, handler: Handler):
  """`handler(call)`, or, for a weight GEMM whose activation alone a vmap batches, the
  contraction of the whole batch (module docstring)."""
  session = sessions.current()
  found = calls.contraction(call) if session is not None else None
  if not isinstance(found, calls.Contraction):
    return handler(call)
  refs = (session.find_weight(found.lhs), session.find_weight(found.rhs))
  if (refs[0] is None) == (refs[1] is None):
    return handler(call)
  weight_first = refs[0] is not None
  x, w = (found.rhs, found.lhs) if weight_first else (found.lhs, found.rhs)
  trace = _batching_trace(x)
  if trace is None or _batching_trace(w) is trace:
    return handler(call)
  return _whole_batch(call, found, weight_first, handler)


def _whole_batch(call: Call, found: calls.Contraction, weight_first: bool, handler: Handler):
  used = found.lhs_letters + found.rhs_letters + found.out_letters
  batch = next(c for c in string.ascii_letters if c not in used)
  lhs_l, rhs_l = found.lhs_letters, found.rhs_letters
  if weight_first:
    rhs_l = batch + rhs_l
  else:
    lhs_l = batch + lhs_l
  equation = f"{lhs_l},{rhs_l}->{batch}{found.out_letters}"
  options = {}
  if found.preferred_element_type is not None:
    options["preferred_element_type"] = found.preferred_element_type
  if call.kwargs.get("precision") is not None:
    options["precision"] = call.kwargs["precision"]

  @jax.custom_batching.custom_vmap
  def contract(lhs, rhs):  # one example's, as written (JAX traces it for the shapes)
    return jnp.einsum(found.equation, lhs, rhs, **options)

  @contract.def_vmap
  def whole_batch(axis_size, in_batched, lhs, rhs):
    batched = Call("einsum", (equation, lhs, rhs), options, jnp.einsum)
    return handle(batched, handler), True

  return contract(found.lhs, found.rhs)


def handle_scan(call: Call, handler: Handler):
  """`handler(call)` for a `lax.scan`; under a vmap that batches its carry or `xs` but no
  param among `xs`, one scan over the whole batch (module docstring)."""
  session = sessions.current()
  bound = inspect.signature(call.original).bind(*call.args, **call.kwargs)
  init, xs = bound.arguments["init"], bound.arguments.get("xs")
  batched = [v for v in jax.tree.leaves((init, xs)) if _batching_trace(v) is not None]
  params = [v for v in jax.tree.leaves(xs) if session and session.find_weight(v) is not None]
  if not batched or any(_batching_trace(v) is not None for v in params):
    return handler(call)
  return _scan_whole_batch(bound, call, handler)


def _scan_whole_batch(bound: inspect.BoundArguments, call: Call, handler: Handler):
  options = dict(bound.arguments)
  body, init, xs = options.pop("f"), options.pop("init"), options.pop("xs", None)

  @jax.custom_batching.custom_vmap
  def scan(init, xs):  # one example's, as written (JAX traces it for the shapes)
    with routing_pause.paused():
      return call.original(body, init, xs, **options)

  @scan.def_vmap
  def whole_batch(axis_size, in_batched, init, xs):
    init_batched, xs_batched = in_batched
    # Every carry leaf batched (the body's output is); a batched `xs` leaf keeps its scan
    # axis first, its batch axis second, as the body's vmap takes it.
    init = jax.tree.map(
      lambda v, b: v if b else jnp.broadcast_to(v, (axis_size, *jnp.shape(v))), init, init_batched
    )
    xs = jax.tree.map(lambda v, b: jnp.moveaxis(v, 0, 1) if b else v, xs, xs_batched)
    xs_axes = jax.tree.map(lambda b: 0 if b else None, xs_batched)
    each = jax.vmap(body, in_axes=(0, xs_axes))
    carry, ys = handle_scan(Call("scan", (each, init, xs), options, call.original), handler)
    ys = jax.tree.map(lambda y: jnp.moveaxis(y, 1, 0), ys)
    out = (carry, ys)
    return out, jax.tree.map(lambda _: True, out)

  return scan(init, xs)


def checkpoint(checkpoint, fun, options: dict, args: tuple, kwargs: dict, run):
  """`run(checkpoint, fun, options, args, kwargs)`, the integration's run of a checkpointed
  function; under a vmap that batches its array arguments but no param among them, `run`
  of the vmapped function, over the whole batch (module docstring)."""
  session = sessions.current()
  static, dynamic, dynamic_kwargs = calls.checkpoint_arguments(options, args, kwargs)
  leaves = jax.tree.leaves((dynamic, dynamic_kwargs))
  batched = [v for v in leaves if _batching_trace(v) is not None]
  params = [v for v in leaves if session and session.find_weight(v) is not None]
  if not batched or any(_batching_trace(v) is not None for v in params):
    return run(checkpoint, fun, options, args, kwargs)
  static_kwargs = {k: v for k, v in kwargs.items() if k not in dynamic_kwargs}

  def call(dynamic, dynamic_kwargs):  # `fun` with its static arguments back in place
    merged, rest = [], iter(dynamic)
    for i in range(len(args)):
      merged.append(args[i] if i in static else next(rest))
    return fun(*merged, **dynamic_kwargs, **static_kwargs)

  traced = {k: v for k, v in options.items() if k not in ("static_argnums", "static_argnames")}
  if isinstance(traced.get("prevent_cse"), (list, tuple)):
    traced["prevent_cse"] = True

  @jax.custom_batching.custom_vmap
  def one_example(dynamic, dynamic_kwargs):  # as written (JAX traces it for the shapes)
    with routing_pause.paused():
      return checkpoint(call, **traced)(dynamic, dynamic_kwargs)

  @one_example.def_vmap
  def whole_batch(axis_size, in_batched, dynamic, dynamic_kwargs):
    axes = jax.tree.map(lambda b: 0 if b else None, tuple(in_batched))
    each = jax.vmap(call, in_axes=axes)
    out = run(checkpoint, each, traced, (dynamic, dynamic_kwargs), {})
    return out, jax.tree.map(lambda _: True, out)

  return one_example(dynamic, dynamic_kwargs)
