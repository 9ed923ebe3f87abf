"""`jax.checkpoint` inside a quantized function, its params handed over as arguments.

A checkpointed function is traced anew, its arguments fresh traced values: no walk back
from an operand leads from a param argument to the param, and what a GEMM writes there
(its delayed-scaling state) must leave the function as an output. So a checkpoint that the
function's code makes while it runs (`jax.checkpoint(block)(x, layer_params)`, Equinox's
`filter_checkpoint`) runs a function that the quantized function wraps (`run_checkpoint`):
each array argument that is a param (or a cast or view of one) is that param inside, and
the call's states and a key go in as two more arguments and come back as an output. A
function checkpointed before the quantized function runs (a decorator at import) is not
reached: `swap_report` lists its GEMMs.
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxquant.functional._call import CallState
from jaxquant.intercept import _calls as calls
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions


def run_checkpoint(
  checkpoint: Callable,
  fun: Callable,
  options: dict,
  args: tuple,
  kwargs: dict,
  state: CallState,
  session_for: Callable[[CallState], sessions.Session],
):
  """`checkpoint(fun, **options)(*args, **kwargs)` with `fun` wrapped (module docstring);
  `session_for(inner_state)` is the session the wrapped function runs in."""
  leaves = jax.tree.leaves(calls.checkpoint_arguments(options, args, kwargs)[1:])
  labels = [provenance.find(leaf, state.params) for leaf in leaves]
  found = {label for label in labels if label is not None}
  key = state.next_key("jax.checkpoint")

  def wrapped(*args_states_key, **kwargs):
    *args, states, key = args_states_key
    leaves = jax.tree.leaves(calls.checkpoint_arguments(options, tuple(args), kwargs)[1:])
    params = {n: v for n, v in state.params.items() if n not in found}
    params.update({label: leaf for label, leaf in zip(labels, leaves, strict=True) if label})
    inner = CallState(state.mode, params, dict(states), key, state.specs, dict(state.stacked))
    with sessions.active(session_for(inner)), routing_pause.paused(False):
      out = fun(*args, **kwargs)
    return out, inner.states

  options = dict(options)
  if isinstance(options.get("prevent_cse"), (list, tuple)):  # one per argument: two more
    options["prevent_cse"] = (*options["prevent_cse"], True, True)
  out, states = checkpoint(wrapped, **options)(*args, dict(state.states), key, **kwargs)
  state.states.update(states)
  return out
