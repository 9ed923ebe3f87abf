"""Which roles a model's GEMMs ask for, and their operands in a high-precision run.

- `RoleRecorder`: a recipe (a `CustomRecipe` whose factory notes every role it is asked
  about and returns None). Run through `jaxquant.flax.quantize_model`, it lists the roles
  of every GEMM the swap-in reaches, named as any recipe sees them, while the model
  computes exactly as without jaxquant.
- `Taps`: during one traced call of the model, each tapped GEMM layer hands over its
  input and kernel (as the GEMM's [M, K] and [K, N] matrices, `gemm_view`) and adds a
  zero "probe" to its output. The gradient of the loss with respect to a probe is the
  layer's output gradient, dy: the third GEMM operand, which exists only in backward.
  The taps live in a context variable for the duration of that call only.

Taps see layers called outside `nn.scan` / `nnx.scan` / `vmap`: operands captured inside
such a transform are its tracers, which cannot leave it. `sensitivity` then says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxquant import recipes
from jaxquant.analysis._gemm_view import GemmView, gemm_view, kernel_of, promoted
from jaxquant.flax import nnx as jq_nnx
from jaxquant.flax._nnx_graph import replace_submodules
from jaxquant.roles import QuantizerRole

# The module_type of the roles the Flax GEMM layers emit (the only ones taps capture).


class RoleRecorder:
  """Records every role it is asked about; as a recipe it quantizes nothing."""

  def __init__(self):
    self._roles: dict[QuantizerRole, None] = {}  # insertion-ordered set

  def _factory(self, role: QuantizerRole):
    self._roles.setdefault(role)
    return None

  @property
  def recipe(self) -> recipes.CustomRecipe:
    return recipes.CustomRecipe(self._factory, name="role_recorder")

  @property
  def roles(self) -> list[QuantizerRole]:
    return list(self._roles)


@dataclasses.dataclass(frozen=True)
class GemmOperands:
  """One call of a GEMM layer: x [M, K], kernel [K, N] and dy [M, N], in its dtypes."""

  x: jax.Array
  kernel: jax.Array
  dy: jax.Array


class Taps:
  """What the tapped GEMM layers hand over during one traced call of the model.

  probes: {name: [zeros like the layer's output, one per call]}: added to the outputs,
    so their gradients are the output gradients. None: a shape-only pass that records
    the output shapes (`probe_shapes`) instead.
  """

  def __init__(
    self, wants: Callable[[str], bool], probes: Optional[dict[str, list[jax.Array]]] = None
  ):
    self.wants = wants
    self.probes = probes
    self.probe_shapes: dict[str, list[jax.ShapeDtypeStruct]] = {}
    # {name: [(x [M, K], kernel [K, N]), one per call]}: arrays of the traced call.
    self.matrices: dict[str, list[tuple[jax.Array, jax.Array]]] = {}
    self.views: dict[str, list[GemmView]] = {}
    self.no_view: set[str] = set()  # tapped layers that are no single GEMM

  def tap(self, module, name: str, x: jax.Array, y: jax.Array, call_kwargs: dict) -> jax.Array:
    if not self.wants(name):
      return y
    view = gemm_view(module, x, call_kwargs)
    if view is None:
      self.no_view.add(name)
      return y
    calls = self.probe_shapes.setdefault(name, [])
    index = len(calls)
    calls.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
    x, kernel = promoted(module, x, kernel_of(module))
    self.matrices.setdefault(name, []).append((view.x_matrix(x), view.kernel_matrix(kernel)))
    self.views.setdefault(name, []).append(view)
    if self.probes is None:
      return y
    return y + self.probes[name][index]


def gemm_operands(
  matrices: dict[str, list[tuple[jax.Array, jax.Array]]],
  views: dict[str, list[GemmView]],
  probe_grads: dict[str, list[jax.Array]],
) -> dict[str, list[GemmOperands]]:
  """Every tapped call's operands, dy from the gradient of its probe."""
  return {
    name: [
      GemmOperands(x, kernel, view.output_matrix(dy, x.shape[0]))
      for (x, kernel), view, dy in zip(calls, views[name], probe_grads[name], strict=False)
    ]
    for name, calls in matrices.items()
  }


_TAPS: contextvars.ContextVar[Optional[Taps]] = contextvars.ContextVar(
  "jaxquant_taps", default=None
)


@contextlib.contextmanager
def tapping(taps: Taps) -> Iterator[Taps]:
  token = _TAPS.set(taps)
  try:
    yield taps
  finally:
    _TAPS.reset(token)


def _tap(module, name: str, x, y, call_kwargs: dict):
  taps = _TAPS.get()
  return y if taps is None else taps.tap(module, name, x, y, call_kwargs)


# ---- Linen: an interceptor on every Dense / DenseGeneral / Einsum call. ----

LINEN_GEMMS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def _linen_tap(next_fun, args, kwargs, context):
  module = context.module
  y = next_fun(*args, **kwargs)
  if context.method_name != "__call__" or not isinstance(module, LINEN_GEMMS) or not args:
    return y
  return _tap(module, "/".join(module.path), args[0], y, kwargs)


def linen_taps():
  """Context in which Linen GEMM layers hand their operands to the active `Taps`."""
  return nn.intercept_methods(_linen_tap)


# ---- NNX: each swapped GEMM layer wrapped in a module that taps it. ----


class NnxTap(nnx.Module):
  """Calls the wrapped jaxquant GEMM layer and taps it (same Params, one level down)."""

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, inputs, *args, **kwargs):
    y = self.inner(inputs, *args, **kwargs)
    return _tap(self.inner, self.inner.role_name or "", inputs, y, kwargs)


def wrap_nnx_gemms(model) -> None:
  """Wraps, in place, every jaxquant NNX GEMM layer reachable from model in a tap."""

  def replace(child, path):
    if isinstance(child, jq_nnx.QUANTIZED_MODULES):
      return NnxTap(child)
    return child if isinstance(child, NnxTap) else None

  replace_submodules(model, replace)


def zero_probes(shapes: dict[str, list[jax.ShapeDtypeStruct]]) -> dict[str, list[jax.Array]]:
  return {name: [jnp.zeros(s.shape, s.dtype) for s in calls] for name, calls in shapes.items()}
