"""`sensitivity`: which GEMM layers of a model suffer most from a recipe's formats.

For a model, one batch, a recipe and a loss, every role the recipe quantizes is measured
alone, everything else in high precision:

- at its GEMMs: the SQNR of the layer's fprop, dgrad and wgrad outputs with only that
  role quantized, on the operands of a high-precision run (`gemm_error`);
- at the model: the relative change of the loss and of the gradient norm, and the
  gradient error |g_q - g| / |g| over all parameters, with only that module's roles
  quantized (`model_runs="module"`, the default: one compiled forward and backward per
  module), or only that role (`model_runs="role"`: three per module), or not at all
  (None).

The roles come from running the model under a recording recipe through the swap-in
(`jaxquant.flax.quantize_model`), so the analysis reaches every GEMM the swap-in does,
named as a recipe sees it. Modules are ranked by the worst SQNR of their three GEMMs
with all their roles quantized, as the recipe runs them; `suggest.suggest_recipe` keeps
the top ones in bf16 (or those of the largest loss change, `rank_by="loss_change"`). The
GEMM SQNR is the report's ranking key, not the gradient error: with
stochastic rounding in the backward pass every module's gradient error is large and
alike (unbiased noise, which training averages out), while a module whose operands the
formats cannot represent (outlier channels, say) shows as an SQNR far below the others'.

"Alone" has one exception: NVFP4's RHT on a wgrad operand needs the other wgrad operand
rotated too, so such a role is measured with its partner's columnwise usage
(`RoleSensitivity.quantized_with` names it).

Delayed scaling is measured as current scaling with the same formats: one batch has no
amax history, and current scaling is what delayed scaling approximates once it has one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional

import jax

from jaxquant import recipes
from jaxquant.analysis import _capture as capture
from jaxquant.analysis import _gemm_error as gemm_error
from jaxquant.analysis._runners import LossFn, runner_for
from jaxquant.analysis._suggest import RankBy
from jaxquant.analysis._table import format_report
from jaxquant.quantizers import (
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  Quantizer,
  for_usage,
)
from jaxquant.roles import QuantizerRole, gemm_roles

ModelRuns = Literal["module", "role"]
MODEL_RUNS = ("module", "role", None)


@dataclasses.dataclass(frozen=True)
class ModelEffect:
  """The model's loss and gradient with some roles quantized, against high precision."""

  loss: float
  grad_norm: float
  loss_change: float  # (loss - loss_hp) / loss_hp
  grad_norm_change: float  # (|g| - |g_hp|) / |g_hp|
  grad_error: float  # |g - g_hp| / |g_hp|, over all parameters


@dataclasses.dataclass(frozen=True)
class RoleSensitivity:
  role: QuantizerRole
  quantizer: Quantizer
  # Quantized along with it, where it cannot be alone: {tensor_type: quantizer} (an RHT
  # partner's columnwise usage, `_partner_for_rht`).
  quantized_with: dict[str, Quantizer]
  # {"fprop", "dgrad", "wgrad": SQNR in dB} with only this role quantized; None where the
  # layer's operands could not be captured (`gemm_note` of the report says why).
  gemm_sqnr_db: Optional[dict[str, float]]
  model: Optional[ModelEffect]  # with model_runs="role"

  @property
  def worst_sqnr_db(self) -> Optional[float]:
    return None if self.gemm_sqnr_db is None else min(self.gemm_sqnr_db.values())


@dataclasses.dataclass(frozen=True)
class ModuleSensitivity:
  module_type: str
  name: str  # the module path, as the recipe's roles see it
  # {"fprop", "dgrad", "wgrad": SQNR in dB} with all of the module's roles quantized, as
  # the recipe runs it; None where its operands could not be captured.
  gemm_sqnr_db: Optional[dict[str, float]]
  roles: tuple[RoleSensitivity, ...]  # the roles the recipe quantizes
  model: Optional[ModelEffect]  # with model_runs="module"

  @property
  def worst_sqnr_db(self) -> Optional[float]:
    """The ranking key: the lowest SQNR of the module's three GEMMs."""
    return None if self.gemm_sqnr_db is None else min(self.gemm_sqnr_db.values())

  @property
  def grad_error(self) -> Optional[float]:
    """The module's gradient error: its own run's, else its worst role's."""
    if self.model is not None:
      return self.model.grad_error
    errors = [r.model.grad_error for r in self.roles if r.model is not None]
    return max(errors) if errors else None


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
  recipe_name: str
  loss: float  # high precision
  grad_norm: float  # high precision
  modules: tuple[ModuleSensitivity, ...]  # ranked: lowest worst-GEMM SQNR first
  unranked: tuple[str, ...] = ()  # modules without GEMM-level figures (`gemm_note`)
  gemm_note: str = ""  # why some layers have no GEMM-level figures

  @property
  def roles(self) -> tuple[RoleSensitivity, ...]:
    return tuple(r for m in self.modules for r in m.roles)

  def module(self, name: str) -> ModuleSensitivity:
    for m in self.modules:
      if m.name == name:
        return m
    raise KeyError(f"no ranked module {name!r}; ranked: {[m.name for m in self.modules]}")

  def table(self, rank_by: RankBy = "gemm_sqnr") -> str:
    """Markdown: the modules ranked by `rank_by` ("gemm_sqnr", the order of `modules`, or
    "loss_change", which needs model_runs="module"), then their roles."""
    return format_report(self, rank_by)


def _stateless(quantizer: Optional[Quantizer]) -> Optional[Quantizer]:
  """Delayed scaling as current scaling with the same element (see the module docstring)."""
  if isinstance(quantizer, DelayedFloat8Quantizer):
    return Float8Quantizer(quantizer.element)
  if isinstance(quantizer, HybridQuantizer):
    return HybridQuantizer(_stateless(quantizer.rowwise), _stateless(quantizer.columnwise))
  return quantizer


def _partner_for_rht(
  quantizers: dict[str, Quantizer], tensor_type: str, backward: str
) -> dict[str, Quantizer]:
  """What must be quantized with `tensor_type` for it to be valid alone.

  RHT on the columnwise usage of input or grad_output (NVFP4's wgrad operands) rotates
  wgrad's contraction dim, which cancels only if the other wgrad operand is rotated too
  (`ops.operands.check_placement`): then the partner's columnwise usage comes along
  (its rowwise usage stays high precision).
  """
  partner = {"input": "grad_output", "grad_output": "input"}.get(tensor_type)
  own = for_usage(quantizers[tensor_type], "columnwise")
  if backward != "quantized" or partner is None or not getattr(own, "rht", False):
    return {}
  columnwise = for_usage(quantizers.get(partner), "columnwise")
  if columnwise is None:
    return {}  # the recipe itself pairs them wrongly; ops.dense says so
  return {partner: HybridQuantizer(rowwise=None, columnwise=columnwise)}


def _recipe_of(assigned: Mapping[QuantizerRole, Quantizer], backward: str) -> recipes.CustomRecipe:
  """Exactly the assigned quantizers; every other role high precision."""
  return recipes.CustomRecipe(
    lambda role: assigned.get(role), backward=backward, name="selected roles"
  )


def _effect(outputs, loss_hp: float, norm_hp: float) -> ModelEffect:
  loss, norm, difference = (float(v) for v in outputs)
  return ModelEffect(
    loss=loss,
    grad_norm=norm,
    loss_change=(loss - loss_hp) / abs(loss_hp),
    grad_norm_change=(norm - norm_hp) / norm_hp,
    grad_error=difference / norm_hp,
  )


def _rank(modules: list[ModuleSensitivity]) -> tuple[list[ModuleSensitivity], list[str]]:
  """Most sensitive (lowest worst-GEMM SQNR) first; modules with no SQNR apart."""
  ranked = sorted(
    (m for m in modules if m.worst_sqnr_db is not None), key=lambda m: m.worst_sqnr_db
  )
  return ranked, [m.name for m in modules if m.worst_sqnr_db is None]


def sensitivity(
  model: Any,
  variables: Optional[dict],
  batch: Any,
  recipe: recipes.CustomRecipe,
  loss_fn: LossFn,
  *,
  key: Optional[jax.Array] = None,
  model_runs: Optional[ModelRuns] = "module",
) -> SensitivityReport:
  """Each quantized role's and module's error alone; see the module docstring.

  Args:
    model: a plain Flax model (Linen `nn.Module`, or NNX `nnx.Module`, which is left as
      it is: the analysis quantizes copies).
    variables: Linen: what `model.init` returned ('params' and any other collections);
      NNX: None.
    batch: any pytree of arrays; it goes to loss_fn as it is.
    recipe: the recipe whose quantizers are measured (roles it maps to None are skipped).
    loss_fn: `loss_fn(call, batch) -> scalar`, where `call(*args, **kwargs)` runs the
      model and returns its output.
    key: PRNG key for stochastic rounding (default key 0).
    model_runs: "module", "role" or None: what the loss and gradient are measured for.
  """
  if model_runs not in MODEL_RUNS:
    raise ValueError(f"sensitivity: model_runs must be one of {MODEL_RUNS}, got {model_runs!r}")
  key = jax.random.key(0) if key is None else key
  runner = runner_for(model, variables, batch, loss_fn, key)
  recorder = capture.RoleRecorder()
  taps = runner.record(recorder)
  quantized = {
    role: q for role in recorder.roles if (q := _stateless(recipe.quantizer(role))) is not None
  }
  if not quantized:
    raise ValueError(
      f"sensitivity: recipe {recipe.name!r} quantizes none of the model's "
      f"{len(recorder.roles)} GEMM roles; nothing to measure"
    )
  operands = runner.capture(recorder, taps.probe_shapes) if taps.probe_shapes else {}
  # The reference run is the untapped model: a probe added to a GEMM's output keeps XLA
  # from fusing the output's cast into what follows, which moves the loss a little.
  (loss_hp, norm_hp, _), reference_grads = runner.effect(_recipe_of({}, recipe.backward), None)
  loss_hp, norm_hp = float(loss_hp), float(norm_hp)
  measure = lambda assigned: _effect(
    runner.effect(_recipe_of(assigned, recipe.backward), reference_grads)[0], loss_hp, norm_hp
  )

  by_module: dict[tuple[str, str], dict[str, Quantizer]] = {}
  for role, quantizer in quantized.items():
    by_module.setdefault((role.module_type, role.name), {})[role.tensor_type] = quantizer
  modules = []
  for (module_type, name), quantizers in by_module.items():
    roles = gemm_roles(module_type, name)
    entries = []
    for tensor_type, quantizer in quantizers.items():
      partner = _partner_for_rht(quantizers, tensor_type, recipe.backward)
      alone = {tensor_type: quantizer, **partner}
      sqnr = (
        gemm_error.gemm_sqnr(operands[name], alone, recipe.backward, key)
        if name in operands
        else None
      )
      effect = measure({roles[t]: q for t, q in alone.items()}) if model_runs == "role" else None
      entries.append(RoleSensitivity(roles[tensor_type], quantizer, partner, sqnr, effect))
    sqnr = (
      gemm_error.gemm_sqnr(operands[name], quantizers, recipe.backward, key)
      if name in operands
      else None
    )
    effect = (
      measure({roles[t]: q for t, q in quantizers.items()}) if model_runs == "module" else None
    )
    modules.append(ModuleSensitivity(module_type, name, sqnr, tuple(entries), effect))
  ranked, unranked = _rank(modules)
  return SensitivityReport(
    recipe.name,
    loss_hp,
    norm_hp,
    tuple(ranked),
    tuple(unranked),
    _gemm_note(by_module, operands, taps),
  )


def _gemm_note(by_module, operands, taps: capture.Taps) -> str:
  missing = sorted(name for (_, name) in by_module if name not in operands)
  if not missing:
    return ""
  reasons = []
  if taps.no_view:
    reasons.append(f"not a single GEMM (batched): {', '.join(sorted(taps.no_view))}")
  other = [n for n in missing if n not in taps.no_view]
  if other:
    reasons.append(
      f"not a Flax Dense / DenseGeneral / Einsum (Linen) or Linear / Einsum (NNX) "
      f"layer called outside scan or vmap: {', '.join(other)}"
    )
  return "no GEMM-level figures for " + "; ".join(reasons)
