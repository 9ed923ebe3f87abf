"""Running a Linen or an NNX model for the sensitivity analysis, one interface for both.

A runner holds the model, its variables, one batch and the loss, and offers:
- `record(recorder)`: a shape-only pass under the role recorder, with taps on every
  linear GEMM: the roles and the shapes of the GEMM outputs (for the probes);
- `capture(recorder, probe_shapes)`: the high-precision run that hands over every tapped
  GEMM's x, kernel and output gradient;
- `effect(recipe, reference_grads)`: loss, gradient norm and gradient error (against
  reference_grads; None: none) of the model quantized per `recipe` through
  `jaxquant.flax.quantize_model`, and its gradients.

`loss_fn(call, batch)` is the user's: `call(*args, **kwargs)` runs the model (Linen:
`apply` with the variables and a 'quant' key; NNX: the module) and returns its output.
Each distinct recipe compiles once (one jitted forward and backward).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant import recipes
from jaxquant.analysis import _capture as capture
from jaxquant.flax import QUANT_RNG, QuantizedModel, quantize_model
from jaxquant.roles import LINEAR

LossFn = Callable[[Callable[..., Any], Any], jax.Array]
PARAMS = "params"


def global_norm(leaves) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))


def _effect_outputs(loss, grads, reference_grads):
  """(loss, |g|, |g - g_reference|) as fp32 scalars, and the gradients themselves."""
  leaves = jax.tree.leaves(grads)
  reference = leaves if reference_grads is None else jax.tree.leaves(reference_grads)
  if [g.shape for g in leaves] != [r.shape for r in reference]:
    raise ValueError(
      "sensitivity: the quantized model's parameters differ from the "
      f"high-precision model's: {[g.shape for g in leaves]} against "
      f"{[r.shape for r in reference]}"
    )
  difference = global_norm(
    [g.astype(jnp.float32) - r.astype(jnp.float32) for g, r in zip(leaves, reference, strict=False)]
  )
  return (loss.astype(jnp.float32), global_norm(leaves), difference), grads


def _check_scalar(loss) -> None:
  if jnp.ndim(loss) != 0:
    raise ValueError(f"sensitivity: loss_fn must return a scalar, got shape {jnp.shape(loss)}")


class LinenRunner:
  def __init__(
    self, model: nn.Module, variables: dict, batch: Any, loss_fn: LossFn, key: jax.Array
  ):
    if isinstance(model, QuantizedModel):
      model = model.module  # the analysis quantizes it itself
    if not isinstance(variables, dict) or PARAMS not in variables:
      raise ValueError(
        "sensitivity: a Linen model needs its variables, a dict with "
        f"'{PARAMS}' (what model.init returns), got {type(variables).__name__}"
      )
    self.model, self.batch, self.loss_fn, self.key = model, batch, loss_fn, key
    self.params = nn.unbox(variables[PARAMS])
    self.rest = {k: v for k, v in variables.items() if k != PARAMS}

  def _loss(self, recipe, params, rest, batch, key):
    quantized = quantize_model(self.model, recipe)
    call = lambda *args, **kwargs: quantized.apply(
      {**rest, PARAMS: params}, *args, rngs={QUANT_RNG: key}, **kwargs
    )
    loss = self.loss_fn(call, batch)
    _check_scalar(loss)
    return loss

  def record(self, recorder: capture.RoleRecorder) -> capture.Taps:
    taps = capture.Taps(
      lambda name: name in {r.name for r in recorder.roles if r.module_type == LINEAR}
    )

    def shapes_only(params, rest, batch, key):
      with capture.tapping(taps), capture.linen_taps():
        return self._loss(recorder.recipe, params, rest, batch, key)

    jax.eval_shape(shapes_only, self.params, self.rest, self.batch, self.key)
    return taps

  def capture(self, recorder: capture.RoleRecorder, probe_shapes) -> dict:
    """{name: [GemmOperands]} of the high-precision run."""
    names = frozenset(probe_shapes)
    views = {}

    def loss_with_probes(params, probes, rest, batch, key):
      with capture.tapping(capture.Taps(names.__contains__, probes)) as taps, capture.linen_taps():
        loss = self._loss(recorder.recipe, params, rest, batch, key)
      views.update(taps.views)
      return loss, taps.matrices

    grad = jax.jit(jax.grad(loss_with_probes, argnums=1, has_aux=True))
    probe_grads, matrices = _captured(
      grad, self.params, capture.zero_probes(probe_shapes), self.rest, self.batch, self.key
    )
    return capture.gemm_operands(matrices, views, probe_grads)

  def effect(self, recipe: recipes.CustomRecipe, reference_grads):

    def run(params, rest, batch, key, reference):
      loss, grads = jax.value_and_grad(lambda p: self._loss(recipe, p, rest, batch, key))(params)
      return _effect_outputs(loss, grads, reference)

    return jax.jit(run)(self.params, self.rest, self.batch, self.key, reference_grads)


class NnxRunner:
  def __init__(self, model, batch: Any, loss_fn: LossFn, key: jax.Array):
    self.model, self.batch, self.loss_fn, self.key = model, batch, loss_fn, key

  def _quantized_copy(self, recipe):
    """A copy of the model (the caller's stays as it is) with its GEMMs quantized."""
    from flax import nnx

    graphdef, state = nnx.split(self.model)
    copy = nnx.merge(graphdef, state)
    return quantize_model(copy, recipe, rngs=nnx.Rngs(**{QUANT_RNG: self.key}))

  def _loss(self, module, batch):
    loss = self.loss_fn(module, batch)
    _check_scalar(loss)
    return loss

  def _tapped(self, recipe):
    module = self._quantized_copy(recipe)
    capture.wrap_nnx_gemms(module)
    return module

  def record(self, recorder: capture.RoleRecorder) -> capture.Taps:
    from flax import nnx

    graphdef, state = nnx.split(self._tapped(recorder.recipe))
    taps = capture.Taps(
      lambda name: name in {r.name for r in recorder.roles if r.module_type == LINEAR}
    )

    def shapes_only(state, batch):
      with capture.tapping(taps):
        return self._loss(_merged(graphdef, state), batch)

    jax.eval_shape(shapes_only, state, self.batch)
    return taps

  def capture(self, recorder: capture.RoleRecorder, probe_shapes) -> dict:
    from flax import nnx

    graphdef, params, rest = nnx.split(self._tapped(recorder.recipe), nnx.Param, ...)
    names = frozenset(probe_shapes)
    views = {}

    def loss_with_probes(params, probes, rest, batch):
      with capture.tapping(capture.Taps(names.__contains__, probes)) as taps:
        loss = self._loss(_merged(graphdef, params, rest), batch)
      views.update(taps.views)
      return loss, taps.matrices

    grad = jax.jit(jax.grad(loss_with_probes, argnums=1, has_aux=True))
    probe_grads, matrices = _captured(
      grad, params, capture.zero_probes(probe_shapes), rest, self.batch
    )
    return capture.gemm_operands(matrices, views, probe_grads)

  def effect(self, recipe: recipes.CustomRecipe, reference_grads):
    from flax import nnx

    graphdef, params, rest = nnx.split(self._quantized_copy(recipe), nnx.Param, ...)

    def run(params, rest, batch, reference):
      loss, grads = jax.value_and_grad(lambda p: self._loss(_merged(graphdef, p, rest), batch))(
        params
      )
      return _effect_outputs(loss, grads, reference)

    return jax.jit(run)(params, rest, self.batch, reference_grads)


def _merged(graphdef, *states):
  """The model inside a traced function, its Variables made there (`copy=True`): a model
  that draws from its Rngs in the forward (an active `nnx.Dropout`) advances their counts,
  which Flax allows only in the trace that made them; the states passed through a `jit`
  into a `grad` were made outside it. Each run starts from the same counts, so every
  recipe meets the same dropout masks."""
  from flax import nnx

  return nnx.merge(graphdef, *states, copy=True)


def _captured(grad, *args):
  try:
    return grad(*args)
  except jax.errors.UnexpectedTracerError as error:
    raise ValueError(
      "sensitivity: a GEMM layer of the model runs inside a JAX transform (nn.scan, "
      "nn.vmap, nnx.scan, ...), whose operands cannot leave it to be measured; analyse an "
      "unrolled copy of the model (the same parameters, the layers not scanned)"
    ) from error


def runner_for(model, variables, batch, loss_fn: LossFn, key: jax.Array):
  if isinstance(model, nn.Module):
    return LinenRunner(model, variables, batch, loss_fn, key)
  from flax import nnx

  if isinstance(model, nnx.Module):
    if variables is not None:
      raise ValueError("sensitivity: an NNX model holds its own variables; pass variables=None")
    return NnxRunner(model, batch, loss_fn, key)
  raise TypeError(
    f"sensitivity: model must be a Flax Linen or NNX module, got {type(model).__name__}"
  )
