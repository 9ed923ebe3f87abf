"""quantize_model(shard_scaling=ops.ShardScaling(mesh, axis)) on 8 CPU devices: a Linen model
of stock Dense layers, trained FSDP-style, scales each device's tokens (the input and the
output gradient of every layer) by their own amax. Its losses follow the per-tensor run's
within FP8 rounding, are not its bits, and its compiled step reduces fewer amaxes across
devices; what it cannot serve is refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_checks import max_reduced_values
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant.flax as jqf
from jaxquant import ops, recipes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

D, FF, TOKENS, LAYERS = 128, 256, 256, 3
ROWS = ("data", "fsdp")
# FSDP: the 'embed' dim of every kernel is split over the fsdp axis; the tokens over both.
RULES = (("embed", "fsdp"), ("mlp", None), ("out", None))
STEPS, LEARNING_RATE = 5, 3.0
# Each run is FP8 (E4M3 forward, E5M2 gradients) of the same fp32 model, differing only in
# which rows share a scale: with per-shard scales the small shards' values land on other
# FP8 codes (the per-tensor run flushes the smallest to subnormals). Measured over the 5
# steps: the two runs' losses differ by up to 6e-4 relative, about as much as each run's
# losses differ from the unquantized model's (up to 1e-3). RTOL is five times that spread
# and below the 2-5 % each SGD step lowers the loss by: weight gradients off by a tenth
# (a shard's product dropped from their sum, a wrong scale) move the later losses by
# 5e-3 to 8e-3 relative.
RTOL = 3e-3


def _init(names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
  """Three stock Dense layers: D -> FF -> D -> D."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(FF, kernel_init=_init(("embed", "mlp")), use_bias=False, name="wi")(x))
    h = nn.gelu(nn.Dense(D, kernel_init=_init(("mlp", "embed")), use_bias=False, name="wm")(h))
    return nn.Dense(D, kernel_init=_init(("embed", "out")), use_bias=False, name="wo")(h)


def _mesh(names=ROWS):
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), names)


def _batch(mesh):
  """(x, target) with their rows over the whole mesh. Each of the 8 row shards has its own
  magnitude (1 down to 1e-2), so its own amax gives it another scale than the tensor's."""
  magnitudes = jnp.repeat(jnp.logspace(0.0, -2.0, 8), TOKENS // 8)[:, None]
  x = jax.random.normal(jax.random.key(1), (TOKENS, D)) * magnitudes
  target = jnp.tanh(x @ (0.2 * jax.random.normal(jax.random.key(2), (D, D))))
  return jax.device_put((x, target), NamedSharding(mesh, P(ROWS)))


def _params(mesh, x):
  boxed = jax.eval_shape(MLP().init, jax.random.key(0), x)["params"]
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
  return jax.device_put(nn.unbox(MLP().init(jax.random.key(0), x)["params"]), shardings)


def _train_step(model, optimizer):
  @jax.jit
  def step(params, opt_state, x, target):
    loss = lambda p: jnp.mean(jnp.square(model.apply({"params": p}, x) - target))
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def _setup(shard_scaled: bool):
  """The train step of the fp8_current model (shard-scaled or not), its first params,
  optimizer state and batch, all on the (data=4, fsdp=2) mesh."""
  mesh = _mesh()
  x, target = _batch(mesh)
  params = _params(mesh, x)
  scaling = ops.ShardScaling(mesh, ROWS) if shard_scaled else None
  model = jqf.quantize_model(MLP(), recipes.fp8_current, shard_scaling=scaling)
  optimizer = optax.sgd(LEARNING_RATE)
  return _train_step(model, optimizer), (params, optimizer.init(params), x, target)


def _run(shard_scaled: bool) -> tuple[np.ndarray, set[str]]:
  """The losses of STEPS steps, and the values its compiled step max-reduces across devices
  (one compilation serves both)."""
  step, (params, opt_state, x, target) = _setup(shard_scaled)
  compiled = step.lower(params, opt_state, x, target).compile()
  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = compiled(params, opt_state, x, target)
    losses.append(float(loss))
  assert params["wi"]["kernel"].sharding.spec == P("fsdp", None)
  return np.array(losses), max_reduced_values(compiled.as_text())


def test_shard_scaled_losses_follow_the_per_tensor_run_with_fewer_amax_reductions():
  per_tensor, per_tensor_amaxes = _run(shard_scaled=False)
  shard_scaled, shard_scaled_amaxes = _run(shard_scaled=True)
  assert per_tensor[-1] < 0.95 * per_tensor[0], per_tensor  # it trains
  np.testing.assert_allclose(shard_scaled, per_tensor, rtol=RTOL)
  # Not a silent no-op: the shards' own scales give other codes, from the first forward on.
  assert np.all(shard_scaled != per_tensor), (shard_scaled, per_tensor)
  # Per-tensor: every layer's weight (split over fsdp), input and output gradient (split
  # over the tokens) reduce their amax across devices. Shard-scaled: only the weights.
  assert len(per_tensor_amaxes) == 3 * LAYERS, per_tensor_amaxes
  assert len(shard_scaled_amaxes) == LAYERS, shard_scaled_amaxes


def test_what_shard_scaling_cannot_serve_is_refused():
  mesh = _mesh()
  scaling = ops.ShardScaling(mesh, ROWS)
  with pytest.raises(ValueError, match="Linen"):
    jqf.quantize_model(
      nnx.Linear(D, D, rngs=nnx.Rngs(0)), recipes.fp8_current, shard_scaling=scaling
    )
  with pytest.raises(TypeError, match="ShardScaling"):
    jqf.quantize_model(MLP(), recipes.fp8_current, shard_scaling="fsdp")
  x = jax.ShapeDtypeStruct((TOKENS, D), jnp.float32)
  # Delayed scaling reduces its recorded amaxes after the cast: nothing to scale per shard.
  delayed = jqf.quantize_model(MLP(), recipes.fp8_delayed, shard_scaling=scaling)
  with pytest.raises(ValueError, match="Float8Quantizer"):
    jax.eval_shape(delayed.init, jax.random.key(0), x)
  current = jqf.quantize_model(MLP(), recipes.fp8_current, shard_scaling=scaling)
  with pytest.raises(ValueError, match="do not split evenly"):
    jax.eval_shape(current.init, jax.random.key(0), jax.ShapeDtypeStruct((12, D), jnp.float32))
  # Tensor parallelism: an axis of more than one device that does not split the rows.
  with pytest.raises(ValueError, match="tensor"):
    ops.ShardScaling(_mesh(("fsdp", "tensor")), "fsdp")
