"""A sensitivity report as text: the ranked modules, then every role's GEMM SQNRs."""

from __future__ import annotations

import math
from typing import Optional

from jaxquant.analysis._gemm_error import GEMMS
from jaxquant.analysis._suggest import RankBy, ranked_modules

# How the table's heading names each ranking.
_RANKED_BY = {
  "gemm_sqnr": "ranked by the worst SQNR of its GEMMs",
  "loss_change": "ranked by the change of the model's loss (largest increase first)",
}


def _percent(value: Optional[float]) -> str:
  return "-" if value is None else f"{100 * value:+.3f}%"


def _db(value: Optional[float]) -> str:
  if value is None:
    return "-"
  return "inf" if math.isinf(value) else f"{value:.1f}"


def format_report(report, rank_by: RankBy = "gemm_sqnr") -> str:
  """Markdown tables: modules ranked by `rank_by` (most sensitive first, `ranked_modules`),
  then roles in that order."""
  modules = ranked_modules(report, rank_by)
  lines = [
    f"Sensitivity to recipe {report.recipe_name!r}, each module (role) quantized alone, "
    f"{_RANKED_BY[rank_by]}. High precision: loss "
    f"{report.loss:.4f}, gradient norm {report.grad_norm:.4g}.",
    "",
    "| rank | module | "
    + " | ".join(f"{g} SQNR (dB)" for g in GEMMS)
    + " | loss change | gradient norm change | gradient error |",
    "| --- | --- | " + " | ".join("---" for _ in GEMMS) + " | --- | --- | --- |",
  ]
  for rank, module in enumerate(modules, 1):
    effect = module.model
    sqnr = module.gemm_sqnr_db or {}
    lines.append(
      f"| {rank} | {module.name} | "
      + " | ".join(_db(sqnr.get(g)) for g in GEMMS)
      + f" | {_percent(effect.loss_change if effect else None)} | "
      f"{_percent(effect.grad_norm_change if effect else None)} | "
      f"{_percent(module.grad_error).lstrip('+')} |"
    )
  lines += [
    "",
    "| module | role | quantizer | "
    + " | ".join(f"{g} SQNR (dB)" for g in GEMMS)
    + " | gradient error | loss change |",
    "| --- | --- | --- | " + " | ".join("---" for _ in GEMMS) + " | --- | --- |",
  ]
  for module in modules:
    for role in module.roles:
      sqnr = role.gemm_sqnr_db or {}
      with_partner = "".join(f" (with {t}'s columnwise)" for t in role.quantized_with)
      lines.append(
        f"| {module.name} | {role.role.tensor_type}{with_partner} | {role.quantizer!r} | "
        + " | ".join(_db(sqnr.get(g)) for g in GEMMS)
        + f" | {_percent(role.model.grad_error if role.model else None).lstrip('+')} | "
        f"{_percent(role.model.loss_change if role.model else None)} |"
      )
  notes = []
  if report.unranked:
    notes.append(f"Not ranked (no GEMM-level figures): {', '.join(report.unranked)}.")
  if report.gemm_note:
    notes.append(report.gemm_note[0].upper() + report.gemm_note[1:] + ".")
  return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
