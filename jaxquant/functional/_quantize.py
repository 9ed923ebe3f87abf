"""`quantize(fn, recipe)`: a function's weight GEMMs quantized, as a function transformation.

`fn` is any JAX function one of whose arguments (`params_argnum`) holds its params: a
dict of arrays, an Equinox module, any pytree. While it runs, every contraction its code
calls (`lax.dot_general`, `jnp.einsum`, `jnp.dot`, `jnp.matmul`, `@`, the ragged dots:
`jaxquant.intercept`) is routed: one whose operand is a param (the leaf itself, or a
cast, transpose, reshape or slice of it, or the param scaled by other params and
constants) is a weight GEMM, whose roles are named by that param's path
("layers/mlp/w_in", `_paths`), run through `ops.dense` / `ops.grouped_dense` per the
recipe; every other one runs as written. `lax.scan` over stacked params is followed into
its body (`_scan`), and `jax.checkpoint` into the function it checkpoints
(`_checkpoint`). Under `jax.vmap` the examples that share a weight are one GEMM
(`jaxquant.intercept._batched`): an Equinox layer written for one example quantizes its
batch's rows together, as a batched model does.

The result is a `QuantizedFunction`: called like `fn` (no state, no key), or through
`init` / `apply` for delayed scaling's state and stochastic rounding's keys
(`_call`). It is a function like any other to `jax.jit`, `jax.grad`, `jax.vmap`,
`jax.checkpoint`, `lax.scan`, `eqx.filter_jit`, and to sharded inputs: the interception
happens while it is traced. Each call opens its own session (contextvars), so threads
may trace it at once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax

from jaxquant import recipes
from jaxquant.functional import _paths as paths
from jaxquant.functional._call import CallState, FunctionHost, Mode
from jaxquant.functional._checkpoint import run_checkpoint
from jaxquant.functional._scan import run_scan
from jaxquant.intercept import _batched as batched
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._found_gemms import check_found_gemms
from jaxquant.intercept._hosts import WeightRef
from jaxquant.intercept._interception import routing
from jaxquant.intercept._routed import checkpointed, handle, handle_scan
from jaxquant.intercept._session import OnUnfit

REPORT = "jaxquant.functional.swap_report"  # named by the warnings and errors of a call


def _handle(call):
  return batched.handle(call, handle)


def _handle_transform(call):
  if call.kind == "scan":
    return batched.handle_scan(call, handle_scan)
  return checkpointed(call)


class QuantizedFunction:
  """`fn` with its weight GEMMs quantized per `recipe` (see `quantize`)."""

  def __init__(
    self,
    fn: Callable,
    recipe: Optional[recipes.CustomRecipe],
    params_argnum: int,
    on_unfit: OnUnfit,
    require_gemm: bool,
  ):
    self.fn = fn
    self.recipe = recipe
    self.params_argnum = params_argnum
    self.on_unfit = on_unfit
    self.require_gemm = require_gemm
    self.first_call_log = sessions.FirstCallLog()
    functools.update_wrapper(self, fn)

  @property
  def _what(self) -> str:
    return f"jaxquant.quantize({getattr(self.fn, '__qualname__', type(self.fn).__name__)})"

  def __call__(self, *args, **kwargs):
    """`fn(*args, **kwargs)` quantized, with no delayed-scaling state and no key."""
    out, _ = self._run("call", args, kwargs, {}, None)
    return out

  def init(self, *args, **kwargs) -> dict:
    """The delayed-scaling state of a call with these arguments (traced abstractly:
    nothing is computed): `{role name: {tensor_type: RoleState}}`, `{}` for a recipe
    without delayed scaling."""
    specs: dict = {}
    arrays, rebuild = paths.split_arrays((args, kwargs))

    def trace(arrays):
      args, kwargs = rebuild(arrays)
      return self._run("init", args, kwargs, {}, None, specs=specs)[0]

    jax.eval_shape(trace, arrays)
    return {name: spec.fresh() for name, spec in specs.items()}

  def apply(self, *args, state: dict, rng: Optional[jax.Array] = None, **kwargs):
    """`(fn(*args, **kwargs), new_state)` quantized: the delayed-scaling GEMMs read
    `state` (from `init`, or the last step's `update_quant_state`) and the new state
    holds the amaxes this call recorded; stochastic rounding draws from `rng`. The
    gradient of the output with respect to `state` carries the grad_output amaxes, for
    `update_quant_state(new_state, state_grads)`."""
    return self._run("apply", args, kwargs, dict(state), rng)

  def _run(self, mode: Mode, args: tuple, kwargs: dict, states: dict, key, *, specs=None):
    """One call of `fn` in `mode` (`_call`): (its output, the states it wrote)."""
    if len(args) <= self.params_argnum:
      raise TypeError(
        f"{self._what}: params_argnum={self.params_argnum}, but the call gave "
        f"{len(args)} positional argument(s)"
      )
    params = paths.named_params(args[self.params_argnum])
    call = CallState(mode, params, states, key, {} if specs is None else specs)
    session = self._session(call, [])
    with sessions.active(session), routing(_handle, _handle_transform):
      out = self.fn(*args, **kwargs)
    self.first_call_log.log(session, self._what)
    sessions.warn_unresolved(session, self._what, REPORT)
    if self.require_gemm and not sessions.reporting():
      check_found_gemms(session, self._what, REPORT, "jaxquant.quantize")
    return out, call.states

  def _session(self, call: CallState, rows: list) -> sessions.Session:
    host = FunctionHost(call)

    def find_weight(operand) -> Optional[WeightRef]:
      label = provenance.find(operand, call.params)
      return None if label is None else WeightRef("", label, host)

    def why_unmatched(operand) -> Optional[str]:
      return provenance.trace_operand(operand, call.params).unresolved

    session_for = lambda inner: self._session(inner, rows)
    run = lambda *checkpointing: run_checkpoint(*checkpointing, call, session_for)

    return sessions.Session(
      self.recipe,
      self.on_unfit,
      find_weight,
      why_unmatched,
      rows=rows,
      log=self.first_call_log,
      scan=lambda scan: run_scan(scan, call, session_for),
      checkpoint=lambda *checkpointing: batched.checkpoint(*checkpointing, run=run),
    )


def quantize(
  fn: Callable,
  recipe: Any = None,
  *,
  params_argnum: int = 0,
  on_unfit: OnUnfit = "error",
  require_gemm: bool = True,
) -> QuantizedFunction:
  """`fn` with its weight GEMMs quantized per `recipe` (module docstring).

  Args:
    fn: a JAX function; its argument `params_argnum` holds the params (any pytree: a
      dict, an Equinox module; its array leaves are the params, named by their paths).
    recipe: a `CustomRecipe`, a preset's name ("fp8_current") or None (autocast's, else
      bf16). Its policies see each weight GEMM's roles named by the param's path.
    params_argnum: which positional argument of `fn` holds the params.
    on_unfit: "error" (default): a GEMM whose shape a quantizer's blocks do not tile
      raises, naming the role and the dim; "high_precision": it runs as written, and
      `swap_report` says why. Tiny GEMMs (K or N below one block) run in high precision
      where the recipe keeps them there (every preset does).
    require_gemm: raise when a recipe that quantizes meets no weight GEMM in a call
      (everything would silently stay in high precision); False allows it.
  """
  sessions.check_on_unfit(on_unfit)
  if not callable(fn):
    raise TypeError(f"jaxquant.quantize: fn must be callable, got {type(fn).__name__}")
  if not isinstance(params_argnum, int) or params_argnum < 0:
    raise ValueError(
      f"jaxquant.quantize: params_argnum must be a non-negative int, got {params_argnum!r}"
    )
  recipe = None if recipe is None else recipes.resolve(recipe)
  return QuantizedFunction(fn, recipe, params_argnum, on_unfit, require_gemm)
