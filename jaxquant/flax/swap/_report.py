"""`swap_report` of a quantized Flax model: one traced call of it, as a `SwapReport`
(`jaxquant.intercept._report`, which says what the rows hold).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jaxquant.flax._rng import QUANT_RNG
from jaxquant.flax.swap._linen import QuantizedModel
from jaxquant.flax.swap._paths import PATH_ATTR
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._report import SwapReport, unreached_rows
from jaxquant.intercept._session import Row


def _path(key) -> str:
  return "/".join(
    str(getattr(k, "key", getattr(k, "idx", k)))
    for k in key
    if not isinstance(k, jax.tree_util.GetAttrKey)  # a Variable's value, a box's
  )


def _param_paths(tree, *, skip: int = 0) -> dict[int, str]:
  """{index among `tree`'s leaves: the param's path}, the first `skip` keys dropped."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {i: _path(key[skip:]) for i, (key, _) in enumerate(leaves)}


def swap_report(model: Any, *args, **kwargs) -> SwapReport:
  """Every contraction one call of a quantized model makes (see the module docstring).

  Linen: `swap_report(quantized_model, variables, *args, **kwargs)`, the model as
  `quantize_model` returned it and the variables of its `init`.
  NNX: `swap_report(quantized_model, *args, **kwargs)`.
  """
  rows: list[Row] = []
  record = sessions.collecting(rows)
  if isinstance(model, nn.Module):
    if not isinstance(model, QuantizedModel):
      raise TypeError(
        "swap_report: pass the model that jaxquant.flax.quantize_model returned, "
        f"got a {type(model).__name__}"
      )
    variables, *args = args
    params = {"params": variables.get("params", {})}
    others = {c: v for c, v in variables.items() if c != "params"}
    apply = lambda p, o, *a: model.apply(
      {**p, **o}, *a, rngs={QUANT_RNG: jax.random.key(0)}, mutable=True, **kwargs
    )
    with record:
      traced = jax.make_jaxpr(apply)(params, others, *args)
    paths = _param_paths(params, skip=1)
  else:
    if not hasattr(model, PATH_ATTR):
      raise TypeError("swap_report: pass an NNX model that jaxquant.flax.quantize_model quantized")
    graphdef, params, others = nnx.split(model, nnx.Param, ...)
    call = lambda p, o, *a: nnx.merge(graphdef, p, o)(*a, **kwargs)
    with record:
      traced = jax.make_jaxpr(call)(params, others, *args)
    paths = _param_paths(params)
  rows.extend(unreached_rows(traced, paths))
  return SwapReport(tuple(rows))
