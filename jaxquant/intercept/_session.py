"""One trace of a quantized model or function: its recipe and options, and what the
interception found.

The swap-in (`jaxquant.flax.swap`) opens a `Session` around each call of a quantized
model, `jaxquant.functional` around each call of a quantized function
(`active(session)`); everything that runs inside reads it through `current()`:
jaxquant's layers, stock layers run by the swap-in, its hooks and the handler of routed
contractions take the model recipe, `on_unfit` and `weight_gather` from it, and record
each contraction they meet as a `Row` (what `swap_report` prints and what the no-GEMM
check counts). The layers read it without knowing the swap-in: it sits below both.

Delayed scaling's input state is shared within a session: layers that read one tensor
(q, k and v of an attention, gate and up of a gated MLP) quantize it with the state of the
first of them (`Session.input_state`), so the compiled step casts it once, keeps one
copy of its codes for backward, and each layer's state records the same amaxes.

The integration also supplies `find_weight(operand)`: which param an operand is (a
`_hosts.WeightRef`), or None. Every contraction of a param met
runs in `param_contraction_scope()`, so that `swap_report` can tell, in the traced
computation, the ones nothing met.

`FirstCallLog`, kept by each quantized model, logs what the first call of each recipe
found: one INFO line on the `jaxquant` logger (`summary`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import threading
import warnings
from typing import Any, Callable, Literal, Optional

import jax
import jax.extend

from jaxquant import recipes
from jaxquant.quantizers import Quantizer

OnUnfit = Literal["error", "high_precision"]
ON_UNFIT = ("error", "high_precision")

# Why a contraction runs in high precision (Row.status).
QUANTIZED = "quantized"
HIGH_PRECISION = "high precision: "
RECIPE_NONE = HIGH_PRECISION + "the recipe maps it to None"
NOT_A_WEIGHT_GEMM = HIGH_PRECISION + "not a weight GEMM"
# No operand traced to a param, but one looks like a weight (`Session.why_unmatched`).
UNRESOLVED = NOT_A_WEIGHT_GEMM + ", but an operand looks like a weight"


def unresolved_status(why: str) -> str:
  return f"{UNRESOLVED} ({why})"


def high_precision_status(reason: str) -> str:
  return HIGH_PRECISION + reason


def unfit_status(reason: str) -> str:
  return high_precision_status(f"the shape does not fit the format ({reason})")


# The name scope of every contraction of a param that the swap-in or a layer met (a weight
# GEMM, quantized or not; one of two params): `swap_report` finds, in the traced
# computation, the contractions of a param outside it, which nothing met (a GEMM inside a
# function that the model's code jitted).
PARAM_CONTRACTION_SCOPE = "jaxquant_param_contraction"


def param_contraction_scope():
  """Marks the operations traced inside as a met contraction of a param's
  (`jax.named_scope`: a name in the traced computation and in the compiled ops' metadata,
  nothing else)."""
  return jax.named_scope(PARAM_CONTRACTION_SCOPE)


@dataclasses.dataclass(frozen=True)
class Row:
  """One contraction the swap-in met."""

  path: str  # the module that made it (or owns its weight)
  call: str  # e.g. "Dense", "einsum '...F,NFH->...NH'"
  shapes: tuple  # operand shapes, the weight's last
  role: Optional[str]  # the role name, None for no weight GEMM
  # The quantizers it runs with; None for a contraction in high precision (a tiny or
  # unfit weight GEMM too, whatever the recipe gave its roles).
  quantizers: Optional[dict[str, Optional[Quantizer]]]
  status: str

  @property
  def is_weight_gemm(self) -> bool:
    return self.role is not None


@dataclasses.dataclass(frozen=True)
class _QuantizedInput:
  """A layer input that a delayed-scaling GEMM of the session quantized first."""

  tensor: Any  # compared by identity: the same traced value, not an equal one
  dtype: Any  # the dtype the layer promoted it to
  trace: Any  # the JAX trace it was quantized in (jax.extend.core.get_opaque_trace_state)
  quantizer: Quantizer
  state: Any  # the DelayedScalingState it was quantized with


def _current_trace():
  return jax.extend.core.get_opaque_trace_state(convention="flax")


@dataclasses.dataclass
class Session:
  recipe: Optional[recipes.CustomRecipe]
  on_unfit: OnUnfit = "error"
  find_weight: Callable[[Any], Any] = lambda operand: None
  # Why an operand that `find_weight` did not match looks like a weight ("path: reason"),
  # else None.
  why_unmatched: Callable[[Any], Optional[str]] = lambda operand: None
  rows: list[Row] = dataclasses.field(default_factory=list)
  # quantize_model's weight_gather (a `ModelWeightGather`), or None.
  weight_gather: Any = None
  # quantize_model's shard_scaling (an `ops.ShardScaling`), or None.
  shard_scaling: Any = None
  # Weight GEMMs met by the sessions of quantized submodels that ran inside this one (their
  # rows are theirs: the innermost recipe holds), so a model whose GEMMs all sit in such a
  # submodel did not run entirely in high precision.
  nested_weight_gemms: int = 0
  quantized_inputs: list[_QuantizedInput] = dataclasses.field(default_factory=list)
  # The quantized model's log, which keeps what it told the user (`warn_once`); None for
  # a session of no model (a hook's).
  log: Optional[FirstCallLog] = None
  # How the integration runs a `lax.scan` its code calls (`_routed.handle_scan`), given
  # the routed `Call`; None: as written.
  scan: Optional[Callable[[Any], Any]] = None
  # How it runs a function its code checkpointed (`_routed.checkpointed`), given
  # `(checkpoint, fun, options, args, kwargs)`: `checkpoint(fun, **options)(*args,
  # **kwargs)` as the integration runs it; None: as written.
  checkpoint: Optional[Callable[..., Any]] = None

  @property
  def met_weight_gemm(self) -> bool:
    return self.nested_weight_gemms > 0 or any(row.is_weight_gemm for row in self.rows)

  def input_state(self, x, dtype, quantizer: Quantizer, state):
    """The delayed-scaling state to quantize the layer input `x`, promoted to `dtype`,
    with: the state of the first GEMM of this session that quantized the same `x` (one
    traced value, in the same trace), promoted alike, with an equal quantizer; else
    `state`, recorded as `x`'s.

    The layers' own states stay theirs to write: each records `x`'s amax into the state
    it was given, so states that were equal (every state from init, from a checkpoint of
    the same model, or after one shared step) stay equal, and the shared bits are the
    bits each layer's own state gives."""
    trace = _current_trace()
    for seen in self.quantized_inputs:
      if seen.tensor is x and (seen.dtype, seen.trace, seen.quantizer) == (dtype, trace, quantizer):
        return seen.state
    self.quantized_inputs.append(_QuantizedInput(x, dtype, trace, quantizer, state))
    return state

  def record(self, row: Row) -> None:
    if row.status != QUANTIZED:
      row = dataclasses.replace(row, quantizers=None)
    self.rows.append(row)
    sink = _REPORT.get()
    if sink is not None:
      sink.append(row)


_SESSION: contextvars.ContextVar[Optional[Session]] = contextvars.ContextVar(
  "jaxquant_swap_session", default=None
)
# Where `swap_report` collects the rows of every session opened while it traces.
_REPORT: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar(
  "jaxquant_swap_report", default=None
)


@contextlib.contextmanager
def collecting(rows: list):
  token = _REPORT.set(rows)
  try:
    yield rows
  finally:
    _REPORT.reset(token)


def reporting() -> bool:
  """Whether `swap_report` is tracing (it lists what was met; nothing raises for it)."""
  return _REPORT.get() is not None


def current() -> Optional[Session]:
  return _SESSION.get()


@contextlib.contextmanager
def active(session: Optional[Session]):
  enclosing = _SESSION.get()
  token = _SESSION.set(session)
  try:
    yield session
  finally:
    _SESSION.reset(token)
    if enclosing is not None and session is not None and session.met_weight_gemm:
      enclosing.nested_weight_gemms += 1


def check_on_unfit(on_unfit: str) -> None:
  if on_unfit not in ON_UNFIT:
    raise ValueError(f"on_unfit must be one of {ON_UNFIT}, got {on_unfit!r}")


LOGGER = logging.getLogger("jaxquant")


def summary(session: Session, what: str) -> str:
  """One line: the weight GEMMs that `session` met, quantized or in high precision and
  why, and the contractions without a param operand."""
  recipe = recipes.resolve(session.recipe)
  weights = [r for r in session.rows if r.is_weight_gemm]
  quantized = sum(r.status == QUANTIZED for r in weights)
  reasons = collections.Counter(
    r.status.removeprefix(HIGH_PRECISION) for r in weights if r.status != QUANTIZED
  )
  why = ", ".join(f"{reason}: {n}" for reason, n in reasons.items())
  others = len(session.rows) - len(weights)
  return (
    f"{what} under recipe {recipe.name!r}: {quantized} of {len(weights)} weight GEMMs "
    f"quantized, {len(weights) - quantized} in high precision{f' ({why})' if why else ''}; "
    f"{others} other contractions (no param operand) in high precision"
  )


def warn_once(key: str, message: str, stacklevel: int = 2) -> None:
  """Warns with `message` once per quantized model and `key` (e.g. a GEMM's), not once per
  trace: Python's own once-per-place rule forgets what it gave whenever a warning filter
  changes, which tracing does. Outside a quantized model's call, every time."""
  session = current()
  if session is None or session.log is None or session.log.first_warning(key):
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def warn_unresolved(session: Session, what: str, report: str = "jaxquant.flax.swap_report") -> None:
  """One warning per model call (per trace, under jit): how many contractions with a
  weight-like operand that no param was traced to ran in high precision, and why
  (`report`: the integration's swap report, which lists them)."""
  rows = [r for r in session.rows if r.status.startswith(UNRESOLVED)]
  if not rows or reporting():
    return  # swap_report lists them
  why = "; ".join(f"{r.call}: {r.status.removeprefix(UNRESOLVED + ' (')[:-1]}" for r in rows)
  warnings.warn(
    f"{what}: {len(rows)} weight-like GEMM(s) left in high precision, their operand not "
    f"traced to a param ({why}). {report} lists them",
    stacklevel=3,
  )


class FirstCallLog:
  """Logs `summary` at the first call of a quantized model under each recipe, and gives
  each warning of `warn_once` once. A model keeps its own (its copies share it), so
  nothing is global. A plain object, hashed by identity: `nn.jit`'s key of a module
  holding the wrapper does not change as it logs."""

  def __init__(self):
    self.logged: set[recipes.CustomRecipe] = set()
    self.warned: set[str] = set()
    self.lock = threading.Lock()

  def first_warning(self, key: str) -> bool:
    """Whether the warning named `key` is given now for the first time."""
    with self.lock:
      first = key not in self.warned
      self.warned.add(key)
    return first

  def log(self, session: Session, what: str) -> None:
    if reporting():
      return  # swap_report lists every row; its trace is no call of the model
    recipe = recipes.resolve(session.recipe)
    with self.lock:
      if recipe in self.logged:
        return
      self.logged.add(recipe)
    LOGGER.info("%s", summary(session, what))
