"""Optimizer, train state and the jitted train and eval steps, for any recipe's model.

The steps thread every non-'params' variable collection (jaxquant's 'quant_state' for
delayed scaling, say): they apply the model with those collections mutable, differentiate
the loss with respect to them too, and let the recipe's `advance_state` turn both into
the next step's collections. They know no collection and no recipe by name.

With `--mesh`, `step_shardings` puts the state on the mesh of a `Placement`
(lm/sharding.py): the params and the optimizer's per-parameter state sharded as the
placement says, the collections and the RNG key replicated, each batch split over the
batch axes; the steps are jitted with these shardings in and out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from lm.model import AUX_LOSSES
from lm.presets import TrainConfig
from lm.recipes import RecipeModel
from lm.sharding import Placement

PARAMS = "params"

# XLA options that make a GPU step reproducible bit for bit: without them two runs of one
# seed part within a few hundred steps (reductions by atomic adds, such as a scatter-add
# gradient's, and GEMM algorithms picked by timing, which another run may pick otherwise).
# XLA:CPU is deterministic already.
DETERMINISTIC_XLA_OPTIONS = {"xla_gpu_deterministic_ops": True, "xla_gpu_autotune_level": 0}


# xla_gpu_deterministic_ops implies xla_gpu_exclude_nondeterministic_ops (the newer, narrower
# flag, which leaves autotuning on); JAX 0.10.2 and 0.12.0 accept both names. A name the
# running XLA does not know fails the compilation ("No such compile option"), so
# check_deterministic_options tries them once at startup.


def compiler_options(deterministic: bool) -> Optional[dict]:
  return dict(DETERMINISTIC_XLA_OPTIONS) if deterministic else None


def check_deterministic_options() -> None:
  """Compiles a trivial function with the deterministic options: a JAX whose XLA dropped
  one of them fails here, naming it, not after the corpus has loaded."""
  try:
    jax.jit(lambda x: x + 1, compiler_options=compiler_options(True))(jnp.float32(0))
  except Exception as error:  # XLA's error type differs between JAX versions
    raise RuntimeError(
      f"deterministic=true: JAX {jax.__version__} does not take the compile options "
      f"{DETERMINISTIC_XLA_OPTIONS} (lm/training.py): {error}"
    ) from error


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  collections: dict  # every non-'params' variable collection, threaded through the steps
  rng: jax.Array  # split once a step for the recipe's RNG streams (stochastic rounding)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.peak_learning_rate,
    warmup_steps=config.warmup_steps,
    decay_steps=config.steps,
    end_value=config.peak_learning_rate * config.final_learning_rate_fraction,
  )
  # No weight decay on vectors (norm scales, biases): decaying them only hurts.
  decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
    optax.clip_by_global_norm(config.grad_clip_norm),
    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_matrices),
  )


def _init_rngs(key: jax.Array, rng_streams: tuple[str, ...]) -> dict:
  keys = jax.random.split(key, 1 + len(rng_streams))
  return {PARAMS: keys[0], **dict(zip(rng_streams, keys[1:], strict=False))}


def _init_fn(
  model: nn.Module, key: jax.Array, sample_tokens: jax.Array, rng_streams: tuple[str, ...]
) -> Callable[[], dict]:
  rngs = _init_rngs(key, rng_streams)
  # Unboxed: jaxquant's own layers (the MoE block's) box their weights with role metadata,
  # which differs between recipes and would make the param trees differ.
  return lambda: nn.unbox(model.init(rngs, sample_tokens))


def init_variables(
  model: nn.Module, key: jax.Array, sample_tokens: jax.Array, rng_streams: tuple[str, ...] = ()
) -> dict:
  return jax.jit(_init_fn(model, key, sample_tokens, rng_streams))()


def placement_for(model: RecipeModel, sample_tokens: jax.Array, mesh: Mesh) -> Placement:
  """Where model's params go on mesh, from the logical axis names its initializers give
  them (init only traced)."""
  rngs = _init_rngs(jax.random.key(0), model.rng_streams)
  boxed = jax.eval_shape(lambda: model.module.init(rngs, sample_tokens))[PARAMS]
  return Placement.for_params(boxed, mesh)


@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Where the steps' inputs and outputs live on a mesh."""

  state: TrainState  # a NamedSharding per part (one for all collections, one for the key)
  batch: NamedSharding
  replicated: NamedSharding  # the loss


def step_shardings(optimizer: optax.GradientTransformation, placement: Placement) -> StepShardings:
  """The params as placement shards them, the optimizer's per-parameter state (Adam's
  moments) like its parameter, everything else replicated."""
  opt_state = optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    jax.eval_shape(optimizer.init, placement.param_shapes),
    placement.params,
    transform_non_params=lambda _: placement.replicated,
  )
  state = TrainState(
    params=placement.params,
    opt_state=opt_state,
    collections=placement.replicated,
    rng=placement.replicated,
  )
  return StepShardings(state, placement.batch, placement.replicated)


def init_train_state(
  model: RecipeModel,
  shared_params: Any,
  key: jax.Array,
  sample_tokens: jax.Array,
  optimizer: optax.GradientTransformation,
  shardings: Optional[StepShardings] = None,
) -> TrainState:
  """A train state for model that starts from shared_params (the same for every recipe),
  placed as `shardings.state` says if given.

  The model's parameters must have the same paths and shapes as shared_params, else the
  recipes would not start alike. Its init is only traced, unless it has collections to
  initialise (delayed-scaling state): a quantized model's init runs its quantized forward
  pass, which would cost a compilation as long as the train step's.
  """
  init_key, rng = jax.random.split(key)
  init = _init_fn(model.module, init_key, sample_tokens, model.rng_streams)
  abstract = jax.eval_shape(init)
  expected = jax.tree.map(jnp.shape, shared_params)
  got = jax.tree.map(jnp.shape, abstract[PARAMS])
  if expected != got:
    raise ValueError(
      "the recipe's model has other parameters than the plain model "
      f"(paths or shapes differ):\n plain: {expected}\n recipe: {got}"
    )
  names = [name for name in abstract if name not in (PARAMS, AUX_LOSSES)]
  variables = jax.jit(init)() if names else {}
  collections = {name: variables[name] for name in names}
  if shardings is not None:
    return _placed_state(shared_params, collections, rng, optimizer, shardings.state)
  # A copy: the train step donates its state, and the next recipe needs the originals.
  params = jax.tree.map(jnp.copy, shared_params)
  return TrainState(
    params=params, opt_state=optimizer.init(params), collections=collections, rng=rng
  )


def _placed_state(
  shared_params: Any,
  collections: dict,
  rng: jax.Array,
  optimizer: optax.GradientTransformation,
  state_shardings: TrainState,
) -> TrainState:
  """The train state created on the mesh, from a copy of shared_params: the train step
  donates its state, the next recipe needs the originals, and jit may hand back an input
  it returns unchanged as the same buffer. With several processes each passes its own copy
  of the same shared_params (computed from the same seed): jit takes an uncommitted
  process-local array as a replicated input, and each process fills its own devices."""

  def start(params, collections, rng):
    params = jax.tree.map(jnp.copy, params)
    return TrainState(
      params=params, opt_state=optimizer.init(params), collections=collections, rng=rng
    )

  return jax.jit(start, out_shardings=state_shardings)(shared_params, collections, rng)


def perturbed(params: Any, key: jax.Array, relative_scale: float) -> Any:
  """Each parameter times 1 + relative_scale * N(0, 1), independently per element."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(
    tree,
    [
      p * (1 + relative_scale * jax.random.normal(k, p.shape, p.dtype))
      for p, k in zip(leaves, keys, strict=False)
    ],
  )


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean cross-entropy in nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _apply(model: RecipeModel, params: Any, collections: dict, windows: jax.Array, rng: jax.Array):
  """(objective, (next-token loss, collections as the model left them)) of windows
  [batch, seq + 1]; the objective adds the auxiliary losses the model sowed."""
  windows = windows.astype(jnp.int32)
  inputs, targets = windows[:, :-1], windows[:, 1:]
  rngs = {stream: jax.random.fold_in(rng, i) for i, stream in enumerate(model.rng_streams)}
  logits, updated = model.module.apply(
    {PARAMS: params, **collections}, inputs, rngs=rngs, mutable=[*collections, AUX_LOSSES]
  )
  updated = dict(updated)
  # Summed over layers too: under nn.scan a sown loss has a leading layer axis.
  aux_loss = sum(
    (jnp.sum(leaf) for leaf in jax.tree.leaves(updated.pop(AUX_LOSSES, {}))), jnp.float32(0)
  )
  loss = next_token_loss(logits, targets)
  return loss + aux_loss, (loss, updated)


def make_train_step(
  model: RecipeModel,
  optimizer: optax.GradientTransformation,
  shardings: Optional[StepShardings] = None,
  deterministic: bool = False,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]]:

  def train_step(state: TrainState, windows: jax.Array):
    rng, step_rng = jax.random.split(state.rng)
    loss_and_collections = lambda params, collections: _apply(
      model, params, collections, windows, step_rng
    )
    # Gradients w.r.t. the collections carry what only the backward pass sees (delayed
    # scaling's grad_output amax); allow_int lets integer state (counters) pass through.
    (_, (loss, forward_collections)), (grads, collection_grads) = jax.value_and_grad(
      loss_and_collections, argnums=(0, 1), has_aux=True, allow_int=True
    )(state.params, state.collections)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    collections = model.advance_state(forward_collections, collection_grads)
    return TrainState(params=params, opt_state=opt_state, collections=collections, rng=rng), loss

  options = compiler_options(deterministic)
  if shardings is None:
    return jax.jit(train_step, donate_argnums=0, compiler_options=options)
  return jax.jit(
    train_step,
    donate_argnums=0,
    in_shardings=(shardings.state, shardings.batch),
    out_shardings=(shardings.state, shardings.replicated),
    compiler_options=options,
  )


def make_eval_step(
  model: RecipeModel, shardings: Optional[StepShardings] = None, deterministic: bool = False
) -> Callable[[TrainState, jax.Array], jax.Array]:

  def eval_step(state: TrainState, windows: jax.Array) -> jax.Array:
    # Collections are mutable here too (a layer may write its state on every call), but
    # evaluation keeps none of the changes.
    _, (loss, _) = _apply(model, state.params, state.collections, windows, state.rng)
    return loss

  options = compiler_options(deterministic)
  if shardings is None:
    return jax.jit(eval_step, compiler_options=options)
  return jax.jit(
    eval_step,
    in_shardings=(shardings.state, shardings.batch),
    out_shardings=shardings.replicated,
    compiler_options=options,
  )
