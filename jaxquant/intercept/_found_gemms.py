"""The no-silent-no-op rule: a recipe that quantizes must have met a weight GEMM."""

from __future__ import annotations

from jaxquant import recipes
from jaxquant.intercept._session import UNRESOLVED, Session
from jaxquant.roles import GROUPED_LINEAR, LINEAR


def check_found_gemms(
  session: Session,
  what: str,
  report: str = "jaxquant.flax.swap_report",
  entry: str = "quantize_model",
) -> None:
  """Raises when `session`'s recipe quantizes but it met no weight GEMM, itself or in a
  quantized submodel (`report` and `entry`: the integration's swap report and the call
  that takes `require_gemm`, which the error names)."""
  if session.met_weight_gemm:
    return
  recipe = recipes.resolve(session.recipe)
  probe = {**recipe.quantizers(LINEAR, ""), **recipe.quantizers(GROUPED_LINEAR, "")}
  if all(q is None for q in probe.values()):
    return  # e.g. bf16: nothing to quantize, nothing missed
  unresolved = [r.status for r in session.rows if r.status.startswith(UNRESOLVED)]
  why = (
    f"; {len(unresolved)} of them with an operand that looks like a weight but is not "
    f"traced to a param: {unresolved[0].removeprefix(UNRESOLVED)}"
    if unresolved
    else ""
  )
  raise ValueError(
    f"{what}: the recipe {recipe.name!r} quantizes, but the model made no GEMM with a "
    f"weight that the swap-in reaches ({len(session.rows)} contractions met, none with a "
    f"param operand{why}), so it would run entirely in high precision. "
    f"{report} lists what was met. If this is intended, pass require_gemm=False to {entry}"
  )
