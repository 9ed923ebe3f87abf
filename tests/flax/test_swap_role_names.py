"""A routed weight's role name reads its own param alone: an embedder that gains a second
weight (gemma 4's per-layer embeddings beside the table) leaves its tied head's role, and
so the policy written for it, unchanged. Linen and NNX."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

VOCAB, D = 64, 32
TOKENS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)


class LinenEmbedder(nn.Module):
  per_layer: bool  # a second 2-D param beside the table, as gemma 4's variants have

  def setup(self):
    self.input_embedding = self.param("input_embedding", nn.initializers.normal(), (VOCAB, D))
    if self.per_layer:
      self.per_layer_embedding = self.param("per_layer", nn.initializers.normal(), (VOCAB, D))

  def encode(self, tokens):
    x = self.input_embedding[tokens]
    return x + self.per_layer_embedding[tokens] if self.per_layer else x

  def decode(self, x):
    return jnp.dot(x, self.input_embedding.T)  # the tied head


class LinenLM(nn.Module):
  per_layer: bool

  @nn.compact
  def __call__(self, tokens):
    embedder = LinenEmbedder(self.per_layer, name="embedder")
    x = nn.Dense(D, name="mlp")(embedder.encode(tokens))
    return embedder.decode(x)


class NnxEmbedder(nnx.Module):
  def __init__(self, per_layer, rngs):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)))
    if per_layer:
      self.per_layer = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)))

  def decode(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class NnxLM(nnx.Module):
  def __init__(self, per_layer, rngs):
    self.embedder = NnxEmbedder(per_layer, rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, tokens):
    return self.embedder.decode(self.mlp(self.embedder.input_embedding[...][tokens]))


def _weight_roles(report) -> list:
  return sorted(r.role for r in report.rows if r.is_weight_gemm)


def test_linen_role_names_do_not_depend_on_sibling_params():
  roles = []
  for per_layer in (False, True):
    model = jqf.quantize_model(LinenLM(per_layer), recipes.fp8_current)
    variables = model.init(jax.random.key(0), TOKENS)
    roles.append(_weight_roles(jqf.swap_report(model, variables, TOKENS)))
  assert roles[0] == roles[1] == ["embedder/input_embedding", "mlp"]


def test_nnx_role_names_do_not_depend_on_sibling_params():
  roles = []
  for per_layer in (False, True):
    model = jqf.quantize_model(NnxLM(per_layer, nnx.Rngs(0)), recipes.fp8_current)
    roles.append(_weight_roles(jqf.swap_report(model, TOKENS)))
  assert roles[0] == roles[1] == ["embedder/input_embedding", "mlp"]
