"""A sensitivity report as a figure (matplotlib, imported only here)."""

from __future__ import annotations

import math
import pathlib
from typing import Optional, Union

from jaxquant.analysis._gemm_error import GEMMS
from jaxquant.analysis._suggest import RankBy, ranked_modules
from jaxquant.roles import TENSOR_TYPES


def plot_sensitivity(
  report,
  path: Optional[Union[str, pathlib.Path]] = None,
  *,
  top: Optional[int] = None,
  rank_by: RankBy = "gemm_sqnr",
):
  """Two panels over the modules ranked by `rank_by` (most sensitive at the top,
  `ranked_modules`): the SQNR (dB) of each module's fprop, dgrad and wgrad with all its
  roles quantized, and each of its roles' worst GEMM SQNR quantized alone.

  Saves to `path` if given; returns the matplotlib Figure.
  """
  try:
    import matplotlib

    if path is not None:
      matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as error:
    raise ImportError("plot_sensitivity needs matplotlib (pip install matplotlib)") from error
  ranked = ranked_modules(report, rank_by)
  modules = list(ranked[:top] if top else ranked)
  rows = list(range(len(modules)))[::-1]  # rank 1 at the top
  names = [m.name for m in modules]
  figure, (module_panel, role_panel) = plt.subplots(
    1, 2, figsize=(11, 1.5 + 0.3 * len(modules)), dpi=110, sharey=True
  )
  for offset, gemm in zip((-0.2, 0.0, 0.2), GEMMS, strict=False):
    points = [
      (row + offset, m.gemm_sqnr_db[gemm])
      for row, m in zip(rows, modules, strict=False)
      if math.isfinite(m.gemm_sqnr_db[gemm])
    ]
    module_panel.barh([r for r, _ in points], [v for _, v in points], height=0.2, label=gemm)
  module_panel.set_yticks(rows, names, fontsize=8)
  module_panel.set_xlabel("GEMM SQNR (dB), module quantized alone")
  module_panel.grid(axis="x", alpha=0.3)
  module_panel.legend(fontsize=8)
  for offset, tensor_type in zip((-0.2, 0.0, 0.2), TENSOR_TYPES, strict=False):
    points = [
      (row + offset, role.worst_sqnr_db)
      for row, m in zip(rows, modules, strict=False)
      for role in m.roles
      if role.role.tensor_type == tensor_type
      and role.worst_sqnr_db is not None
      and math.isfinite(role.worst_sqnr_db)
    ]
    if points:
      role_panel.plot([v for _, v in points], [r for r, _ in points], "o", label=tensor_type)
  role_panel.set_xlabel("worst SQNR of the GEMMs it feeds (dB), role quantized alone")
  role_panel.grid(axis="x", alpha=0.3)
  role_panel.legend(fontsize=8)
  figure.suptitle(
    f"Sensitivity to {report.recipe_name}: most sensitive GEMM modules at the top (by {rank_by})"
  )
  figure.tight_layout()
  if path is not None:
    figure.savefig(path)
    plt.close(figure)
  return figure
