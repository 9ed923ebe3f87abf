"""The gemma-style model of custom layers (routed contractions) under data parallel +
FSDP on 8 CPU devices: the losses of the one-device run, as test_sharding checks for
stock layers (the same tolerances and reasons; see its docstring)."""

import custom_layers as cl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant.flax as jqf
from jaxquant import recipes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

# FSDP: every 'embed' axis of a weight is split over the data axis.
RULES = (
  ("embed", "data"),
  ("vocab", None),
  ("mlp", None),
  ("gate", None),
  ("heads", None),
  ("kv", None),
)
RTOL = 1e-5


def windows():
  starts = jax.random.randint(jax.random.key(0), (8, 1), 0, cl.VOCAB)
  return (starts + jnp.arange(cl.SEQ + 1)) % cl.VOCAB


def _fsdp(model, params, windows):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  boxed = jax.eval_shape(model.init, jax.random.key(0), windows[:, :-1])["params"]
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
  assert shardings["layer_0"]["mlp"]["gating_einsum"]["w"].spec == P(None, "data", None)
  return (
    jax.device_put(params, shardings),
    jax.device_put(windows, NamedSharding(mesh, P("data"))),
  )


# fp8_current: two steps, the first forward and the loss after one update (which carries
# the sharded gradients). From the third on, fp32 noise that moved one element across an
# FP8 rounding boundary shows (test_sharding's docstring): under JAX 0.12 this model's
# third loss differs by 2e-4 relative between the runs, its first two by 1e-7.
@pytest.mark.parametrize(
  "recipe, steps",
  [(recipes.bf16, 8), (recipes.fp8_current, 2)],
  ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.slow
def test_fsdp_losses_match_one_device(recipe, steps):
  data = windows()
  model = jqf.quantize_model(cl.GemmaStyleLM(dtype=jnp.float32), recipe)
  params, _ = tt.linen_init(model, data)
  single, _ = tt.train_linen(model, params, {}, steps, data, tt.SGD)
  params, data = _fsdp(model, params, data)
  sharded, (final, _, _) = tt.train_linen(model, params, {}, steps, data, tt.SGD)
  assert final["layer_0"]["mlp"]["gating_einsum"]["w"].sharding.spec[1] == "data"
  assert single[-1] < 0.9 * single[0], single
  np.testing.assert_allclose(sharded, single, rtol=RTOL)
