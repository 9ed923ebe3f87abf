"""`swap_report` of a quantized function: one traced call, as a `SwapReport`
(`jaxquant.intercept._report` says what its rows hold). Each row's role is the path of
the param the GEMM contracts; its path column is the param's parent in the pytree.
"""

from __future__ import annotations

import jax

from jaxquant.functional import _paths as paths
from jaxquant.functional._quantize import QuantizedFunction
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._report import SwapReport, unreached_rows


def swap_report(qfn: QuantizedFunction, *args, state=None, **kwargs) -> SwapReport:
  """Every contraction one call `qfn(*args, **kwargs)` makes, and how each one runs.

  Nothing is computed (`jax.make_jaxpr`). With `state` (from `qfn.init`) the call reads
  it as `apply` would; without, delayed-scaling GEMMs trace on fresh states, as `init`.
  """
  if not isinstance(qfn, QuantizedFunction):
    raise TypeError(
      f"swap_report: pass the function that jaxquant.quantize returned, got {type(qfn).__name__}"
    )
  rows: list = []
  arrays, rebuild = paths.split_arrays((args, kwargs))
  mode = "init" if state is None else "apply"

  def call(arrays, state):
    args, kwargs = rebuild(arrays)
    return qfn._run(mode, args, kwargs, dict(state or {}), jax.random.key(0), specs={})[0]

  with sessions.collecting(rows):
    traced = jax.make_jaxpr(call)(arrays, state)
  rows.extend(unreached_rows(traced, _param_indices(args, qfn.params_argnum)))
  return SwapReport(tuple(rows))


def _param_indices(args: tuple, params_argnum: int) -> dict[int, str]:
  """{index among the traced arrays: the param's path}: the array leaves of the args
  before the params come first, then the params' own."""
  before = len(paths.split_arrays(args[:params_argnum])[0])
  names = list(paths.named_params(args[params_argnum]))
  return {before + i: name for i, name in enumerate(names)}
