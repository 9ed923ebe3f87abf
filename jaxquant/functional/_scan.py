"""`lax.scan` inside a quantized function: a loop over stacked params (a model's layers).

In the scan's body each param slice is a new traced value that no walk back from an
operand leads to the stacked param, and what a GEMM writes there (its delayed-scaling
state) must leave the body as an output. So a scan the function calls runs a body that
the quantized function wraps (`run_scan`):

- each leaf of `xs` that is a param (or a cast or view of one, `_provenance`) is that
  param inside the body: a GEMM of its slice is a GEMM of the param, named by its path
  (one role for every layer of the stack, as `nn.scan` names a scanned layer's);
- the states of those params (one per layer, stacked along the scan) go in as `xs` and
  come back as the scan's outputs; every other state of the call goes through the carry;
- the body's key is the call's key folded with the scan's draw and the iteration, so
  each layer rounds with keys of its own.

Under `init` the body records its weights' states as stacked by the scan's length.
"""

from __future__ import annotations

import inspect
from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant.functional._call import CallState
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._calls import Call


def _length(bound: inspect.BoundArguments, xs_leaves: list) -> Optional[int]:
  """The scan's length: its `length`, else its `xs`' leading axis; None with neither."""
  length = bound.arguments.get("length")
  if length is not None:
    return int(length)
  return int(jnp.shape(xs_leaves[0])[0]) if xs_leaves else None


def run_scan(call: Call, state: CallState, session_for) -> object:
  """The scan `call` with its body wrapped (module docstring). `session_for(body_state)`
  is the session the body runs in, over the body's `CallState`."""
  bound = inspect.signature(call.original).bind(*call.args, **call.kwargs)
  body, init = bound.arguments["f"], bound.arguments["init"]
  xs = bound.arguments.get("xs")
  xs_leaves, xs_tree = jax.tree.flatten(xs)
  length = _length(bound, xs_leaves)
  if length is None:  # no length to scan over: lax.scan says so
    with routing_pause.paused(False):
      return call.fallback()
  scanned = [provenance.find(leaf, state.params) for leaf in xs_leaves]
  labels = {label for label in scanned if label is not None}
  threaded = state.mode == "apply"
  sliced = {n: s for n, s in state.states.items() if n in labels} if threaded else {}
  carried = {n: s for n, s in state.states.items() if n not in labels} if threaded else {}
  scan_key = state.next_key("lax.scan")

  def wrapped(carry, x):
    carry, carried_states = carry
    x, sliced_states, index = x
    leaves = jax.tree.leaves(x) if x is not None else []
    params = {n: v for n, v in state.params.items() if n not in labels}
    params.update({label: leaf for label, leaf in zip(scanned, leaves, strict=True) if label})
    inner = CallState(
      state.mode,
      params,
      {**carried_states, **sliced_states},
      None if scan_key is None else jax.random.fold_in(scan_key, index),
      state.specs,
      {**state.stacked, **{n: state.stacked.get(n, ()) + (length,) for n in labels}},
    )
    with sessions.active(session_for(inner)), routing_pause.paused(False):
      carry, y = body(carry, x)
    carried_out = {n: inner.states[n] for n in carried_states}
    sliced_out = {n: inner.states[n] for n in sliced_states}
    return (carry, carried_out), (y, sliced_out)

  arguments = dict(bound.arguments)
  arguments["f"] = wrapped
  arguments["init"] = (init, carried)
  arguments["xs"] = (jax.tree.unflatten(xs_tree, xs_leaves), sliced, jnp.arange(length))
  arguments["length"] = length
  (carry, carried_out), (ys, sliced_out) = call.original(**arguments)
  state.states.update(carried_out)
  state.states.update(sliced_out)
  return carry, ys
