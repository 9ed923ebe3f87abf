"""The NNX side of the swap-in: stock layers swapped, every other contraction routed.

`quantize_nnx_model` swaps `nnx.Linear` / `nnx.Einsum` for jaxquant's layers
(`nnx.swap_modules`), names every other module by its path (a static attribute,
`PATH_ATTR`, which NNX carries through split / merge, so it is there inside `nnx.jit`,
`nnx.scan` and `nnx.remat` too), and gives the model a subclass of its own class whose
`__call__` runs under a `session.Session` with contractions routed to `routed.handle`.

NNX modules do not record which of them is running: the operand's owner is found among
the `self` of the running methods on the Python stack (innermost first), as the module
whose own `nnx.Param` the operand is (`provenance.find`). Routed contractions of NNX
models take no delayed-scaling recipe (their state would have to exist before the first
trace); stochastic rounding draws from the `rngs` given to `quantize_model`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import jax
from flax import nnx

from jaxquant import recipes
from jaxquant.flax import interception, provenance, routed
from jaxquant.flax import session as sessions
from jaxquant.flax.nnx import NATIVE_MODULES, swap_modules
from jaxquant.flax.session import WeightRef
from jaxquant.quantizers import needs_key, needs_state

PATH_ATTR = "jaxquant_path"
RNGS_ATTR = "jaxquant_rngs"
_BASE_ATTR = "_jaxquant_plain_class"


@dataclasses.dataclass(frozen=True)
class NnxHost:
  """Keys from the model's `rngs` ("quant" stream); no delayed-scaling state."""

  rngs: Optional[nnx.Rngs]

  def key(self, quantizers, what: str) -> Optional[jax.Array]:
    if not any(needs_key(q) for q in quantizers.values()):
      return None
    if self.rngs is None:
      raise ValueError(
        f"{what}: its recipe rounds stochastically; pass "
        "rngs=nnx.Rngs(quant=seed) to quantize_model"
      )
    return self.rngs.quant()

  def state(self, param, roles, quantizers, what: str) -> None:
    if any(needs_state(q) for q in quantizers.values()):
      raise ValueError(
        f"{what}: delayed scaling needs state that an NNX model's routed "
        "contractions do not hold; use a current-scaling recipe for this role "
        "or build the layer from jaxquant.flax.nnx's Linear / Einsum"
      )
    return None

  def write_state(self, param, new_state) -> None:
    raise AssertionError("routed NNX contractions hold no state")


def _own_params(module: nnx.Module) -> dict[str, Any]:
  return {name: v.get_value() for name, v in vars(module).items() if isinstance(v, nnx.Param)}


def _running_modules():
  """The NNX modules (named by the swap-in) whose methods are on the stack, innermost first."""
  frame = inspect.currentframe()
  seen = set()
  while frame is not None:
    module = frame.f_locals.get("self")
    if isinstance(module, nnx.Module) and hasattr(module, PATH_ATTR) and id(module) not in seen:
      seen.add(id(module))
      yield module
    frame = frame.f_back


def _finder(rngs):
  def find_weight(operand) -> Optional[WeightRef]:
    for module in _running_modules():
      params = _own_params(module)
      name = provenance.find(operand, params)
      if name is not None:
        weights = [n for n, v in params.items() if len(getattr(v, "shape", ())) >= 2]
        return WeightRef(getattr(module, PATH_ATTR), name, weights == [name], NnxHost(rngs))
    return None

  return find_weight


def _routed_class(cls: type, recipe, on_unfit, require_gemm) -> type:
  """`cls` whose `__call__` runs the model with its contractions routed."""

  def __call__(self, *args, **kwargs):
    session = sessions.Session(recipe, on_unfit, _finder(getattr(self, RNGS_ATTR, None)))
    with sessions.active(session), interception.routing(routed.handle):
      y = cls.__call__(self, *args, **kwargs)
    if require_gemm:
      sessions.check_found_gemms(session, f"quantize_model({cls.__name__})")
    return y

  return type(
    cls.__name__,
    (cls,),
    {
      "__call__": __call__,
      "__module__": cls.__module__,
      "__qualname__": cls.__qualname__,
      _BASE_ATTR: cls,
    },
  )


def quantize_nnx_model(
  model: nnx.Module,
  recipe: Optional[recipes.CustomRecipe],
  *,
  annotate: bool,
  rngs: Optional[nnx.Rngs],
  on_unfit: str,
  require_gemm: bool,
) -> nnx.Module:
  """In place: stock layers swapped, modules named, the model's calls routed. Returns it."""
  swap_modules(model, recipe, annotate=annotate, rngs=rngs)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and not isinstance(node, NATIVE_MODULES):
      setattr(node, PATH_ATTR, "/".join(str(k) for k in path))
  if rngs is not None:
    setattr(model, RNGS_ATTR, nnx.data(rngs))
  base = getattr(type(model), _BASE_ATTR, type(model))  # quantized again: the plain class
  model.__class__ = _routed_class(base, recipe, on_unfit, require_gemm)
  return model
