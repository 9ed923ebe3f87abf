"""One trace of a quantized model: its recipe and options, and what the swap-in found.

`quantize_model`'s Linen wrapper and NNX model open a `Session` around each call of the
model (`active(session)`); everything the swap-in does inside reads it through
`current()`: stock layers, jaxquant's layers and hooks, and the handler of routed
contractions (`jaxquant.flax.routed`) take the model recipe and `on_unfit` from it, and
record each contraction they meet as a `Row` (what `swap_report` prints and what the
no-GEMM check counts).

The framework side (Linen or NNX) supplies `find_weight(operand) -> WeightRef | None`:
which param of the model an operand is, and the `Host` that owns it (where its
delayed-scaling state lives and where a stochastic-rounding key comes from).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Literal, Optional

from jaxquant import recipes
from jaxquant.quantizers import Quantizer

OnUnfit = Literal["error", "high_precision"]
ON_UNFIT = ("error", "high_precision")

# Why a contraction runs in high precision (Row.status).
QUANTIZED = "quantized"
RECIPE_NONE = "high precision: the recipe maps it to None"
NOT_A_WEIGHT_GEMM = "high precision: not a weight GEMM"


def unfit_status(reason: str) -> str:
  return f"high precision: the shape does not fit the format ({reason})"


@dataclasses.dataclass(frozen=True)
class Row:
  """One contraction the swap-in met."""

  path: str  # the module that made it (or owns its weight)
  call: str  # e.g. "Dense", "einsum '...F,NFH->...NH'"
  shapes: tuple  # operand shapes, the weight's last
  role: Optional[str]  # the role name, None for no weight GEMM
  quantizers: Optional[dict[str, Optional[Quantizer]]]
  status: str

  @property
  def is_weight_gemm(self) -> bool:
    return self.role is not None


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """A param the model's code contracted: its owner's path, its name, whether it is the
  owner's only weight (then the role is named by the path alone), and the owner's host."""

  path: str
  param: str
  only_weight: bool
  host: Any

  @property
  def role_name(self) -> str:
    if self.only_weight:
      return self.path
    return f"{self.path}/{self.param}" if self.path else self.param


@dataclasses.dataclass
class Session:
  recipe: Optional[recipes.CustomRecipe]
  on_unfit: OnUnfit = "error"
  find_weight: Callable[[Any], Optional[WeightRef]] = lambda operand: None
  rows: list[Row] = dataclasses.field(default_factory=list)
  # quantize_model's weight_gather (a jaxquant.flax.weight_gather.ModelWeightGather), or None.
  weight_gather: Any = None

  def record(self, row: Row) -> None:
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


def current() -> Optional[Session]:
  return _SESSION.get()


@contextlib.contextmanager
def active(session: Optional[Session]):
  token = _SESSION.set(session)
  try:
    yield session
  finally:
    _SESSION.reset(token)


def check_on_unfit(on_unfit: str) -> None:
  if on_unfit not in ON_UNFIT:
    raise ValueError(f"on_unfit must be one of {ON_UNFIT}, got {on_unfit!r}")


def check_found_gemms(session: Session, what: str) -> None:
  """The no-silent-no-op rule: a recipe that quantizes must have found a weight GEMM."""
  if any(row.is_weight_gemm for row in session.rows):
    return
  recipe = recipes.resolve(session.recipe)
  probe = {**recipe.quantizers("linear", ""), **recipe.quantizers("grouped_linear", "")}
  if all(q is None for q in probe.values()):
    return  # e.g. bf16: nothing to quantize, nothing missed
  raise ValueError(
    f"{what}: the recipe {recipe.name!r} quantizes, but the model made no GEMM with a "
    f"weight that the swap-in reaches ({len(session.rows)} contractions met, none with a "
    "param operand), so it would run entirely in high precision. jaxquant.flax.swap_report "
    "lists what was met. If this is intended, pass require_gemm=False to quantize_model"
  )
