"""The NNX side of the swap-in: stock layers swapped, every other contraction routed.

`quantize_nnx_model` replaces, in place, the stock layers of `_targets.NNX_LAYERS`
(`nnx.Linear`, `nnx.Einsum`) by jaxquant's twins holding the *same* Param variables
(`swap_modules`), binds every jaxquant layer (NnxGroupedDense included) to its module
path and the model recipe, names every other module by its path (a static attribute,
`PATH_ATTR`, which NNX carries through split / merge, so it is there inside `nnx.jit`,
`nnx.scan` and `nnx.remat` too), and gives the model a subclass of its own class whose
`__call__` runs under a `Session` with contractions routed to `_routed.handle`. A
submodel quantized before (its class keeps its options) keeps its recipe for the layers
below it, and its own `__call__` opens its own session: the innermost one holds. While a
session runs, every module of the model carries its token (`_session_token`), so that
`nnx.jit` on a module's own method traces anew for each call of the model and never
reuses a trace made under another recipe or outside the model.

NNX modules do not record which of them is running: the operand's owner is found among
the `self` of the running methods on the Python stack (innermost first), as the module
whose own `nnx.Param` the operand is (`_provenance.find`); that module holds the
delayed-scaling state of the GEMM, made at its first call (`_hosts.NnxHost`; in a model
whose MaxText hooks keep theirs in `_overwrite_with_gradient`, there too:
`_bridged.GradientStateHost`). Stochastic
rounding draws one key per model call from the `rngs` given to
`quantize_model`, where the model lives; every GEMM inside (swapped layer or routed
contraction) derives its own from it (`_rng.call_keys`), so no stream is mutated from
inside `jax.checkpoint`, `nnx.remat` or `nnx.scan`, and no layer holds the stream (a
scanned stack could not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import uuid
from typing import Optional

from flax import nnx

from jaxquant import recipes
from jaxquant.flax._nnx_graph import path_str, replace_submodules
from jaxquant.flax._rng import call_keys
from jaxquant.flax.swap._bridged import GradientStateHost, holds_overwrite_with_gradient
from jaxquant.flax.swap._hosts import NnxHost
from jaxquant.flax.swap._paths import PATH_ATTR, is_linen_bridge, own_params
from jaxquant.flax.swap._targets import NNX_LAYERS, NNX_NATIVE_LAYERS
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept._found_gemms import check_found_gemms
from jaxquant.intercept._hosts import WeightRef
from jaxquant.intercept._interception import routing
from jaxquant.intercept._routed import handle
from jaxquant.intercept._session import FirstCallLog, Session, active, reporting, warn_unresolved

# The static attribute that names the session a trace of the model belongs to
# (`_session_token`).
SESSION_ATTR = "jaxquant_session"
RNGS_ATTR = "jaxquant_rngs"
_BASE_ATTR = "_jaxquant_plain_class"
_OPTIONS_ATTR = "_jaxquant_swap_options"


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


def _finder(host: type[NnxHost]):
  def find_weight(operand) -> Optional[WeightRef]:
    for module in _running_modules():
      params = own_params(module)
      name = provenance.find(operand, params)
      if name is not None:
        return WeightRef(getattr(module, PATH_ATTR), name, host(module))
    return None

  return find_weight


def _why_unmatched(operand) -> Optional[str]:
  """Why an operand no module's param matched looks like a weight, if it does."""
  for module in _running_modules():
    why = provenance.trace_operand(operand, own_params(module)).unresolved
    if why is not None:
      path = getattr(module, PATH_ATTR)
      return f"{path}: {why}" if path else why
  return None


_ABSENT = object()  # a module without the session attribute (`_session_token`)


@contextlib.contextmanager
def _session_token(model: nnx.Module, token: str):
  """Gives every module of `model`'s graph the static attribute `SESSION_ATTR = token`
  while the session runs; then puts back what each had (most have none).

  `nnx.jit` keys its cached trace on the graphdef of its module arguments (their types
  and static attributes) and the arrays' shapes, never on the session, while the routed
  contractions, and the rows that the no-GEMM check, `swap_report` and the log count,
  exist only while a trace runs. A token per session, in every graphdef, makes each call
  of the quantized model trace its `nnx.jit` parts (also under `nnx.remat` and
  `nnx.scan`) anew: no recipe reuses another's trace, a second call records its rows,
  and a module called outside the session (no token) never meets a quantized trace. A
  random name, not an id: a trace cached under a dead session's id would match the next
  session that got the id.

  Set with `object.__setattr__`: the model may be an outer trace's (a `jax.jit` closing
  over it), where NNX refuses a mutation because an array attribute could leak a tracer;
  a string cannot, and the attribute is gone again when the call returns.
  """
  saved = [
    (node, vars(node).get(SESSION_ATTR, _ABSENT))
    for _, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Module) and not is_linen_bridge(node)
  ]
  for module, _ in saved:
    object.__setattr__(module, SESSION_ATTR, token)
  try:
    yield
  finally:
    for module, value in saved:
      if value is not _ABSENT:
        object.__setattr__(module, SESSION_ATTR, value)
      elif SESSION_ATTR in vars(module):  # gone if nnx.jit failed updating the module
        object.__delattr__(module, SESSION_ATTR)


def _quantized_twin(module: nnx.Module) -> nnx.Module:
  """A jaxquant layer holding the very same Variables and attributes as `module`.

  Built abstractly (no weights are initialised), then given the original's attributes.
  """
  cls = NNX_LAYERS[type(module)]
  if issubclass(cls, nnx.Linear):
    make = lambda: cls(
      module.in_features, module.out_features, use_bias=module.use_bias, rngs=nnx.Rngs(0)
    )
  else:
    make = lambda: cls(module.einsum_str, module.kernel_shape, module.bias_shape, rngs=nnx.Rngs(0))
  twin = nnx.eval_shape(make)
  for attr, value in vars(module).items():
    if not attr.startswith("_pytree__"):
      setattr(twin, attr, value)
  twin.quant_rngs = nnx.data(None)  # keys from the model call's (`call_keys`)
  return twin


@dataclasses.dataclass(frozen=True)
class _Options:
  """What `quantize_model` was given for a model, kept on its routed class: a model
  quantized before an outer one is keeps them for its layers (the innermost wins)."""

  recipe: Optional[recipes.CustomRecipe]
  annotate: bool


def _quantized_submodels(model: nnx.Module) -> dict[tuple, nnx.Module]:
  """{path: module} of the modules below `model` that were quantized themselves."""
  return {
    tuple(path): node
    for path, node in nnx.iter_graph(model)
    if path and isinstance(node, nnx.Module) and hasattr(type(node), _OPTIONS_ATTR)
  }


def swap_modules(
  model: nnx.Module,
  recipe: Optional[recipes.CustomRecipe],
  *,
  annotate: bool = False,
) -> nnx.Module:
  """Replaces, in place, every nnx.Linear / nnx.Einsum reachable from `model` (every
  reference to it) by its quantized twin, and binds every jaxquant layer to its module
  path and the model recipe: the recipe of the innermost module that was quantized,
  this model or one below it. Returns `model`."""
  if type(model) in NNX_LAYERS:
    raise TypeError(
      f"quantize_model: the model itself is a {type(model).__name__}; wrap it "
      "in a module, or build jaxquant.flax.nnx's layer directly"
    )
  submodels = _quantized_submodels(model)

  def options(path) -> _Options:
    for n in range(len(path) - 1, 0, -1):
      inner = submodels.get(tuple(path[:n]))
      if inner is not None:
        return getattr(type(inner), _OPTIONS_ATTR)
    return _Options(recipe, annotate)

  def replace(child, path):
    own = options(path)
    if type(child) in NNX_LAYERS:
      twin = _quantized_twin(child)
      twin.bind_role(path_str(path), own.recipe, annotate=own.annotate)
      return twin
    if isinstance(child, NNX_NATIVE_LAYERS):
      child.bind_role(path_str(path), own.recipe)
      return child
    return None

  replace_submodules(model, replace)
  return model


def _routed_class(cls: type, recipe, on_unfit, require_gemm, annotate, host) -> type:
  """`cls` whose `__call__` runs the model with its contractions routed, their weights'
  state kept by `host` (an `NnxHost` type)."""

  first_call_log = FirstCallLog()  # this quantized model's: one line per recipe
  # One call at a time (re-entrant for a nested call in the same thread): the session
  # token sits on the model's modules, which concurrent eager calls of the model share.
  calling = threading.RLock()

  def __call__(self, *args, **kwargs):
    session = Session(recipe, on_unfit, _finder(host), _why_unmatched, log=first_call_log)
    with calling, _session_token(self, uuid.uuid4().hex):
      with active(session), routing(handle), call_keys(getattr(self, RNGS_ATTR, None)):
        y = cls.__call__(self, *args, **kwargs)
    what = f"quantize_model({cls.__name__})"
    first_call_log.log(session, what)
    warn_unresolved(session, what)
    # Under swap_report a model with no weight GEMM is what the report is asked to show.
    if require_gemm and not reporting():
      check_found_gemms(session, what)
    return y

  return type(
    cls.__name__,
    (cls,),
    {
      "__call__": __call__,
      "__module__": cls.__module__,
      "__qualname__": cls.__qualname__,
      _BASE_ATTR: cls,
      _OPTIONS_ATTR: _Options(recipe, annotate),
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
  swap_modules(model, recipe, annotate=annotate)
  for path, node in nnx.iter_graph(model):
    # A Linen bridge makes every attribute a Linen variable: it takes none (`_paths`).
    if (
      isinstance(node, nnx.Module)
      and not isinstance(node, NNX_NATIVE_LAYERS)
      and not is_linen_bridge(node)
    ):
      setattr(node, PATH_ATTR, path_str(path))
  if rngs is not None:
    setattr(model, RNGS_ATTR, nnx.data(rngs))
  base = getattr(type(model), _BASE_ATTR, type(model))  # quantized again: the plain class
  # MaxText's train step keeps the params and `_overwrite_with_gradient` alone: where the
  # model's hooks keep their state there, so do its routed GEMMs.
  host = GradientStateHost if holds_overwrite_with_gradient(model) else NnxHost
  model.__class__ = _routed_class(base, recipe, on_unfit, require_gemm, annotate, host)
  return model
