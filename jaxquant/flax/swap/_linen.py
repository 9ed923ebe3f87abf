"""The Linen side of the swap-in: `QuantizedModel`, its method interceptor, and which
module's param an operand is.

`QuantizedModel(model, recipe)` shares the model's scope (`nn.share_scope`, so the param
tree is the model's own) and runs it under `nn.intercept_methods`: the interceptor runs
the layers of `_targets.LINEN_LAYERS` through their routes (Flax's Dense / DenseGeneral /
Einsum computed by `linen.gemm_call` from their own attributes and params; jaxquant's
own layers, GroupedDense included, with the model recipe as their fallback), and every
other contraction of the model's code is routed to `_routed.handle`. It runs them only
while its own session is the current one: inside a nested `QuantizedModel`, that one's
interceptor runs them, so the innermost wrapper's recipe and options hold, as they do for
routed contractions (which read the current session).

`ModuleStack` holds the modules whose methods are running (pushed by the interceptor,
innermost last). An operand is a weight when it is one of those modules' own params
(`_provenance.find`: the param, or a cast / view of it), innermost module first; that
module owns it (with `nn.share_scope`, the scope's module path) and is its `LinenHost`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any, Optional

import flax.linen as nn
from flax.core import FrozenDict, meta

from jaxquant import ops, recipes
from jaxquant.flax._weight_gather import ModelWeightGather
from jaxquant.flax.swap._hosts import LinenHost
from jaxquant.flax.swap._targets import LINEN_LAYERS
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._found_gemms import check_found_gemms
from jaxquant.intercept._hosts import WeightRef
from jaxquant.intercept._interception import routing
from jaxquant.intercept._routed import handle
from jaxquant.intercept._session import OnUnfit, Session


def _raw(value: Any) -> Any:
  """A param as its module stores it, without boxes (and without their sharding
  constraint: the walk from an operand passes through the constraint to this value)."""
  while isinstance(value, meta.AxisMetadata):
    value = value.value if hasattr(value, "value") else value.unbox()
  return value


def own_params(module: nn.Module) -> dict[str, Any]:
  """The params of the module's own scope (not its children's), unboxed."""
  params = module.variables.get("params", {})
  return {name: _raw(v) for name, v in params.items() if not isinstance(v, Mapping)}


def descendant_params(module: nn.Module) -> dict[str, Any]:
  """The params of the module's child scopes, unboxed, by their path below the module
  (`gating_einsum/w`): a module may contract a child's param itself, the child's method
  having returned it (gemma 4's MoE experts, held by modules that only return them)."""
  found = {}

  def collect(prefix, tree):
    for name, value in tree.items():
      if isinstance(value, Mapping):
        collect(f"{prefix}{name}/", value)
      elif prefix:
        found[f"{prefix}{name}"] = _raw(value)

  collect("", module.variables.get("params", {}))
  return found


@dataclasses.dataclass
class ModuleStack:
  """The Linen modules whose methods are running, innermost last, and the session token
  that the scopes of the quantized model carry (`_session_scopes`).

  A module whose scope lacks the token is not the model's: the root of a nested
  `Module.apply` inside it (a tied head, `lm_head.apply({"params": {"kernel": wte.T}},
  x)` as transformers' FlaxGPT2 writes it), whose variables are what the model's code
  handed it. Its own params are no weights of the model: an operand is traced through
  them to the model's param (the embedding), which names the role and holds the state,
  and whose module draws the keys."""

  token: Optional[str] = None
  modules: list = dataclasses.field(default_factory=list)

  def owns(self, module: nn.Module) -> bool:
    """Whether `module` is the quantized model's (not a nested apply's root or child)."""
    return module.scope is not None and module.scope.flags.get(SESSION_FLAG) == self.token

  @contextlib.contextmanager
  def running(self, module: nn.Module):
    self.modules.append(module)
    try:
      yield
    finally:
      self.modules.pop()

  def find_weight(self, operand) -> Optional[WeightRef]:
    """The running module whose own param the operand is, innermost first; else the
    running module one of whose children's params it is (named by its path from that
    module, its state kept in that module's scope)."""
    running = [m for m in reversed(self.modules) if self.owns(m)]
    for params_of in (own_params, descendant_params):
      for module in running:
        name = provenance.find(operand, params_of(module))
        if name is not None:
          return WeightRef("/".join(module.path), name, LinenHost(module))
    return None

  def why_unmatched(self, operand) -> Optional[str]:
    """Why an operand no module's param matched looks like a weight, if it does."""
    for module in reversed(self.modules):
      if self.owns(module):
        why = provenance.trace_operand(operand, own_params(module)).unresolved
        if why is not None:
          return f"{'/'.join(module.path)}: {why}" if module.path else why
    return None


def _linen_interceptor(
  recipe: Optional[recipes.CustomRecipe],
  annotate: bool,
  stack: Optional[ModuleStack] = None,
  session: Optional[Session] = None,
):
  """Runs the layers of `LINEN_LAYERS` per `recipe` while `session` is the current one
  (None: while no quantized model runs). Inside a nested quantized model another
  session is current: its own interceptor runs them, so the innermost wrapper's recipe,
  `on_unfit` and `weight_gather` hold there, as they do for its routed contractions."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if stack is None:
      return _dispatch(module, next_fun, args, kwargs, context.method_name)
    with stack.running(module):
      return _dispatch(module, next_fun, args, kwargs, context.method_name)

  def _dispatch(module, next_fun, args, kwargs, method_name):
    layer = method_name == "__call__" and next(
      (layer for layer in LINEN_LAYERS if layer.matches(module)), None
    )
    if not layer or sessions.current() is not session:
      return next_fun(*args, **kwargs)
    if stack is not None and not stack.owns(module):
      # A nested apply's layer (module docstring of ModuleStack): run as written, its
      # contraction routed, its weight traced to the model's param.
      return next_fun(*args, **kwargs)
    with routing_pause.paused():
      return layer.route(module, next_fun, args, kwargs, recipe=recipe, annotate=annotate)

  return intercept


def _correct_scope_paths(module: nn.Module) -> None:
  """Gives the scopes of `module`'s bound descendants the paths of their variables.

  `nn.share_scope` moves the children the model had bound before (submodules passed as
  attributes, `Outer(backbone=Block())`) onto the wrapper's scope, but their scopes keep
  the path they were made with, under the wrapper's field name ('module/backbone'),
  while their params live at 'backbone'. Module paths, and so role names, come from
  these scopes; modules bound later push from the corrected ones."""
  for child in module._state.children.values():
    if isinstance(child, nn.Module) and child.scope is not None and child.scope.parent is not None:
      scope = child.scope
      scope.path = scope.parent.path + (scope.name,)
      scope.debug_path = scope.parent.debug_path + (scope.name,)
      _correct_scope_paths(child)


# The scope flag that names the session a trace of the model belongs to (see `_session_scopes`).
SESSION_FLAG = "jaxquant_session"


def _bound_scopes(module: nn.Module):
  """The scopes of `module` and of its bound descendants."""
  if module.scope is not None:
    yield module.scope
  for child in module._state.children.values():
    if isinstance(child, nn.Module):
      yield from _bound_scopes(child)


@contextlib.contextmanager
def _session_scopes(module: nn.Module, token: Optional[str]):
  """Puts `token`, the running session's name, into the flags of `module`'s scope and of
  its bound descendants' (scopes pushed later copy their parent's flags).

  Flax's `nn.jit` keys its cached trace on the module's fields and its scope's flags
  (and the arguments' shapes), never on the interceptor or the session, while the routed
  contractions, and the rows that the no-GEMM check, `swap_report` and the log count,
  exist only while a trace runs. A token per session makes every call of a quantized
  model trace its `nn.jit` parts anew: a recipe or model change never reuses another's
  trace, and a second call records its rows. A random name, not an id: a trace cached
  under a dead session's id would match the next session that got the id."""
  saved = [(scope, scope.flags) for scope in _bound_scopes(module)]
  for scope, flags in saved:
    scope.flags = FrozenDict({**flags, SESSION_FLAG: token})
  try:
    yield
  finally:
    for scope, flags in saved:
      scope.flags = flags


class QuantizedModel(nn.Module):
  """A Linen model whose GEMMs follow `recipe`: its Dense / DenseGeneral / Einsum layers
  and every contraction its own code makes with a param operand.

  Same params as `module`. Only `__call__` is quantized; to quantize the GEMMs of
  another method, call it inside `intercepting(recipe)`. At init the model runs twice:
  first as written, so that every param exists (and each routed weight's role name sees
  all its module's weights), then quantized; the recipe is asked once per role.
  """

  module: nn.Module
  recipe: Optional[recipes.CustomRecipe] = None
  annotate: bool = False
  on_unfit: OnUnfit = "error"
  require_gemm: bool = True
  weight_gather: Optional[ModelWeightGather] = None
  shard_scaling: Optional[ops.ShardScaling] = None
  # What the first call under each recipe logged (`_session.FirstCallLog`); copies of the
  # wrapper (Flax clones it at each init / apply) share it.
  first_call_log: sessions.FirstCallLog = dataclasses.field(
    default_factory=sessions.FirstCallLog, compare=False, repr=False
  )

  def setup(self):
    nn.share_scope(self, self.module)
    _correct_scope_paths(self.module)

  def __call__(self, *args, **kwargs):
    if self.is_initializing():
      # As written (jaxquant's own layers without a recipe of their own in bf16): this
      # creates every param, and asks the recipe nothing. No session either: inside an
      # outer quantized model, the outer one's would take these layers over.
      with recipes.autocast(recipes.bf16), sessions.active(None):
        with _session_scopes(self.module, None):
          self.module(*args, **kwargs)
    recipe = None if self.recipe is None else recipes.resolve(self.recipe)
    token = uuid.uuid4().hex
    stack = ModuleStack(token)
    session = Session(
      recipe,
      self.on_unfit,
      stack.find_weight,
      stack.why_unmatched,
      weight_gather=self.weight_gather,
      shard_scaling=self.shard_scaling,
      log=self.first_call_log,
    )
    with sessions.active(session), routing(handle), _session_scopes(self.module, token):
      with nn.intercept_methods(_linen_interceptor(recipe, self.annotate, stack, session)):
        y = self.module(*args, **kwargs)
    what = f"quantize_model({type(self.module).__name__})"
    self.first_call_log.log(session, what)
    sessions.warn_unresolved(session, what)
    # Under swap_report a model with no weight GEMM is what the report is asked to show.
    if self.require_gemm and not sessions.reporting():
      check_found_gemms(session, what)
    return y


def intercepting(recipe: Optional[recipes.CustomRecipe], annotate: bool = False):
  """Context in which every Linen Dense / DenseGeneral / Einsum call follows `recipe`
  (a quantized model running inside keeps its own)."""
  recipe = None if recipe is None else recipes.resolve(recipe)
  return nn.intercept_methods(_linen_interceptor(recipe, annotate))
