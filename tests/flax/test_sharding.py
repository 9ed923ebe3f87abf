"""Data parallel + FSDP (params sharded by logical axis rules) on 8 CPU devices.

What sharding may and may not change:

- Quantization must not change at all: a per-tensor scale comes from the amax of the
  whole tensor, never of one shard, so quantizing a sharded tensor gives the very bits of
  the unsharded one (first test, every preset's quantizers).
- A sharded GEMM or reduction adds its partial sums in another order: fp32 rounding
  noise, ~1e-7 relative per op. Training amplifies such noise step by step (Adam
  normalises tiny gradient differences; a value that lands on the other side of an FP8 /
  FP4 rounding boundary moves by a whole quantization step), so losses are compared
  where that amplification has not set in. In bf16 compute the noise is ~1e-3 per op
  (each partial result is rounded to bf16), for the plain Flax model exactly as for the
  bf16 recipe; the comparisons below therefore run the fp32-compute model.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant.flax as jqf
from jaxquant import recipes, scaling
from jaxquant.ops._quantize import quantize
from jaxquant.quantizers import needs_state
from jaxquant.roles import TENSOR_TYPES, QuantizerRole

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

# FSDP: every 'embed' axis of a kernel is split over the data axis.
RULES = (
  ("embed", "data"),
  ("vocab", None),
  ("mlp", None),
  ("qkv", None),
  ("heads", None),
  ("kv", None),
)
# fp32 noise (~1e-7 per op) through a few dozen ops of forward and backward: 1e-5 leaves
# two orders of magnitude below anything a wrong reduction or scale would give.
RTOL = 1e-5


def _preset_quantizers():
  """Every distinct quantizer of every preset (by role of a 'linear' module)."""
  found = {}
  for recipe in recipes.PRESETS.values():
    for t in TENSOR_TYPES:
      q = recipe.quantizer(QuantizerRole("linear", t, "proj"))
      if q is not None:
        found.setdefault(repr(q), q)
  return list(found.values())


@pytest.mark.slow
def test_quantizing_a_sharded_tensor_gives_the_unsharded_bits():
  quantizers = _preset_quantizers()
  # Magnitudes spread over decades, the largest in one shard only: a per-shard amax
  # would give every other shard another scale.
  x = jax.random.normal(jax.random.key(0), (128, 128)) * jnp.logspace(-3, 2, 128)[:, None]
  x = x.at[3, 5].set(1e4)

  @jax.jit
  def quantize_all(x, key):
    out = []
    for q in quantizers:
      state = scaling.init_state(q) if needs_state(q) else None
      out.append(quantize(x, q, key=key, state=state))
    return out

  mesh = jax.make_mesh((4, 2), ("rows", "cols"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded_x = jax.device_put(x, NamedSharding(mesh, P("rows", "cols")))
  expected = quantize_all(x, jax.random.key(1))
  got = quantize_all(sharded_x, jax.random.key(1))
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  jax.tree.map(np.testing.assert_array_equal, got, expected)


def _fsdp(model, params, collections, windows):
  """The train state and batch placed for data parallel + FSDP on an 8-device mesh."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  boxed = jax.eval_shape(model.init, jax.random.key(0), windows[:, :-1])["params"]
  param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
  assert param_shardings["layer_0"]["mlp"]["wi"]["kernel"].spec == P("data", None)
  return (
    jax.device_put(params, param_shardings),
    jax.device_put(collections, NamedSharding(mesh, P())),
    jax.device_put(windows, NamedSharding(mesh, P("data"))),
  )


# Trained with plain gradient descent (tt.SGD), so fp32 noise stays fp32 noise; Adam
# would turn it into sign flips of whole learning-rate steps (see tt.SGD). bf16: nothing
# quantized. fp8_current (per-tensor scales from global amaxes): a few steps, before one
# element that fp32 noise moved across an FP8 rounding boundary can shift the loss by more
# than fp32 noise (the amplification described above). The quantizers of the other
# presets are covered bit for bit by the test above; their train steps cost minutes more
# to compile.
@pytest.mark.parametrize(
  "recipe, steps",
  [(recipes.bf16, 8), (recipes.fp8_current, 4)],
  ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.slow
def test_fsdp_losses_match_one_device(recipe, steps):
  windows = tt.batch(batch_size=8)
  model = jqf.quantize_model(tt.LinenLM(dtype=jnp.float32), recipe)
  params, collections = tt.linen_init(model, windows)
  # Both steps at XLA's default CPU level, where the dot sums in the same order at either
  # shape (tt.XLA_DEFAULT_OPT).
  options = tt.XLA_DEFAULT_OPT
  single, _ = tt.train_linen(model, params, collections, steps, windows, tt.SGD, options)
  params, collections, windows = _fsdp(model, params, collections, windows)
  sharded, (final_params, _, _) = tt.train_linen(
    model, params, collections, steps, windows, tt.SGD, options
  )
  assert final_params["layer_0"]["mlp"]["wi"]["kernel"].sharding.spec[0] == "data"
  assert single[-1] < 0.9 * single[0], single  # it trains: the params did move
  np.testing.assert_allclose(sharded, single, rtol=RTOL)
