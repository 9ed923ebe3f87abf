"""quantize_model(weight_gather=ModelWeightGather(...)) on 8 CPU devices: each quantized
Dense / DenseGeneral / Einsum kernel is quantized shard by shard and all-gathered as 8-bit
codes, with the values and gradients of the model without the option; what it cannot
serve is refused with an error naming the layer."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant.flax as jqf
from jaxquant import recipes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

D, HEADS, HEAD_DIM, FF = 128, 4, 32, 256
RULES = (("embed", "fsdp"), ("heads", "tensor"), ("kv", None), ("mlp", "tensor"), ("layers", None))
# A GEMM split along K on one side and gathered on the other adds its partial sums in
# another order: fp32 noise, ~1e-7 relative per op.
RTOL = 1e-5


def _init(names):
  return nn.with_logical_partitioning(nn.initializers.normal(0.05), names)


class Block(nn.Module):
  """Attention-style projections of three Flax layer kinds, then an MLP."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral(
      (HEADS, HEAD_DIM), kernel_init=_init(("embed", "heads", "kv")), use_bias=False, name="q"
    )(x)
    o = nn.Einsum(
      (HEADS, HEAD_DIM, D),
      "...hk,hkd->...d",
      kernel_init=_init(("heads", "kv", "embed")),
      use_bias=False,
      name="o",
    )(q)
    h = nn.gelu(nn.Dense(FF, kernel_init=_init(("embed", "mlp")), use_bias=False, name="wi")(x + o))
    return x + nn.Dense(D, kernel_init=_init(("mlp", "embed")), use_bias=False, name="wo")(h)


class Stack(nn.Module):
  """Two blocks under nn.scan (a stacked 'layers' axis on every kernel)."""

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      lambda block, carry, _: (block(carry), None),
      variable_axes={"params": 0},
      split_rngs={"params": True, "quant": True},
      length=2,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scan(Block(name="block"), x, None)[0]


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))


def _placed(model, x, mesh):
  boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), RULES)
  shardings = jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
  )
  params = jax.device_put(nn.unbox(model.init(jax.random.key(0), x)["params"]), shardings)
  return params, shardings


@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4"])
@pytest.mark.slow
def test_gathered_model_matches_and_gathers_codes(recipe):
  mesh = _mesh()
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (4, 64, D), jnp.float32), NamedSharding(mesh, P("fsdp"))
  )
  params, shardings = _placed(Stack(), x, mesh)
  gather = jqf.ModelWeightGather(mesh, shardings, "fsdp")
  plain = jqf.quantize_model(Stack(), recipes.get(recipe))
  gathered = jqf.quantize_model(Stack(), recipes.get(recipe), weight_gather=gather)

  def value_and_grads(model):
    loss = lambda p: jnp.mean(
      jnp.square(model.apply({"params": p}, x, rngs={"quant": jax.random.key(2)}))
    )
    return jax.jit(jax.value_and_grad(loss))

  # Each step traced once: its lowering gives the HLO and its executable the values.
  plain_step, gathered_step = (value_and_grads(m).lower(params) for m in (plain, gathered))
  want = plain_step.compile()(params)
  got = gathered_step.compile()(params)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-7), got, want)
  assert re.search(r"all_gather.*xui8>", gathered_step.as_text()), "no 8-bit all-gather"
  assert not re.search(r"all_gather.*xui8>", plain_step.as_text())


def test_spec_lookup_drops_a_scanned_stack_and_merges_contracted_axes():
  mesh = _mesh()
  specs = {
    "stack": {
      "q": {"kernel": P(None, "fsdp", "tensor", None)},
      "o": {"kernel": NamedSharding(mesh, P("tensor", None, "fsdp"))},
    }
  }
  gather = jqf.ModelWeightGather(mesh, specs)
  # q: kernel [D, heads, head_dim] under a stacked axis; GEMM kernel [D, heads * head_dim].
  q = gather.kernel_gather(("stack", "q", "kernel"), (D, HEADS, HEAD_DIM), (0, 1, 2), 1, "q")
  assert q.kernel_spec == P("fsdp", "tensor") and q.axis == ("fsdp",)
  # o: kernel [heads, head_dim, D], heads and head_dim contracted: GEMM kernel [K, D].
  o = gather.kernel_gather(("stack", "o", "kernel"), (HEADS, HEAD_DIM, D), (0, 1, 2), 2, "o")
  assert o.kernel_spec == P("tensor", "fsdp")


def test_what_it_cannot_serve_is_refused():
  mesh = _mesh()
  gather = jqf.ModelWeightGather(
    mesh, {"a": {"kernel": P(None, None, "fsdp")}, "s": {"kernel": P("fsdp", None, None)}}
  )
  with pytest.raises(ValueError, match="no entry for 'b'"):
    gather.kernel_gather(("b", "kernel"), (D, D), (0, 1), 1, "b")
  with pytest.raises(ValueError, match="interleaved shards"):  # head_dim sharded, heads not
    gather.kernel_gather(("a", "kernel"), (D, HEADS, HEAD_DIM), (0, 1, 2), 1, "a")
  with pytest.raises(ValueError, match="scanned stack"):
    gather.kernel_gather(("s", "kernel"), (D, D), (0, 1), 1, "s")
  with pytest.raises(TypeError, match="ModelWeightGather"):
    jqf.quantize_model(Stack(), recipes.fp8_current, weight_gather=gather.mesh)
  with pytest.raises(ValueError, match="for Linen models"):
    jqf.quantize_model(
      nnx.Linear(D, D, rngs=nnx.Rngs(0)), recipes.fp8_current, weight_gather=gather
    )


class OwnContraction(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", _init(("embed", "mlp")), (D, FF))
    return x @ w


def test_a_weight_the_model_contracts_itself_is_refused():
  mesh = _mesh()
  x = jnp.ones((64, D), jnp.float32)
  params, shardings = _placed(OwnContraction(), x, mesh)
  model = jqf.quantize_model(
    OwnContraction(), recipes.fp8_current, weight_gather=jqf.ModelWeightGather(mesh, shardings)
  )
  with pytest.raises(ValueError, match="weight_gather gathers the kernels of Dense"):
    model.apply({"params": params}, x)
  bf16 = jqf.quantize_model(
    OwnContraction(),
    recipes.bf16,  # nothing quantized: XLA gathers
    weight_gather=jqf.ModelWeightGather(mesh, shardings),
  )
  np.testing.assert_array_equal(
    bf16.apply({"params": params}, x), OwnContraction().apply({"params": params}, x)
  )
