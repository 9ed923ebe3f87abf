"""A weight transformed elementwise before its contraction (Gemma 4's `w = w * w_scale`:
by a scalar param, a per-channel param broadcast, `1 + scale`, a constant) is still that
weight's GEMM: the swap-in quantizes the contracted (scaled) values under the role of the
param that carries the weight's shape. An operand that mixes in the activations (`x * w`,
then contracted) stays an activation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import ops, recipes
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _session as sessions

B, D, F = 32, 64, 32
RECIPE = recipes.fp8_current
CHANNEL_SCALE = np.linspace(0.5, 1.5, F, dtype=np.float32)


def scale_shapes(kind):
  """{name: shape} of the params scaling the weight, per kind of scaling."""
  return {"param": {"w_scale": ()}, "channel": {"w_scale": (F,)}, "one_plus": {"scale": (F,)}}.get(
    kind, {}
  )


def scaled(kind, w, scales):
  """The weight as the layer contracts it."""
  if kind == "param":
    return w * scales["w_scale"]
  if kind == "channel":
    return w * scales["w_scale"][None, :]
  if kind == "one_plus":
    return w * (1 + scales["scale"])
  if kind == "constant":
    return w * 0.5
  assert kind == "constant_channel"
  return w * CHANNEL_SCALE


KINDS = ("param", "channel", "one_plus", "constant", "constant_channel")
scale_init = nn.initializers.uniform(1.0)


class LinenScaledEinsum(nn.Module):
  """Gemma 4's einsum layer: its weight scaled before `jnp.einsum`."""

  kind: str

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, F))
    scales = {n: self.param(n, scale_init, s) for n, s in scale_shapes(self.kind).items()}
    return jnp.einsum("bd,df->bf", x, scaled(self.kind, w, scales))


class LinenBlock(nn.Module):
  kind: str
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(LinenScaledEinsum) if self.remat else LinenScaledEinsum
    return layer(self.kind, name="proj")(x)


def reference(kind, params, x):
  """The GEMM the swap-in must run: `ops.dense` of the scaled weight, under the recipe."""
  p = params["params"]["proj"]
  w = scaled(kind, p["w"], {n: p[n] for n in scale_shapes(kind)})
  return ops.dense(x, w, recipe=RECIPE, name="proj/w")


def inputs():
  return jax.random.normal(jax.random.key(1), (B, D), jnp.float32)


def assert_quantized_as(report, role):
  (row,) = report.rows
  assert (row.role, row.status) == (role, sessions.QUANTIZED), row
  assert row.quantizers["weight"] is not None and row.quantizers["input"] is not None


@pytest.mark.parametrize("kind", KINDS)
def test_linen_scaled_weight_is_its_weight_gemm(kind):
  x = inputs()
  model = jqf.quantize_model(LinenBlock(kind), RECIPE)
  params = jax.jit(model.init)(jax.random.key(0), x)
  assert_quantized_as(jqf.swap_report(model, params, x), "proj/w")
  np.testing.assert_array_equal(jax.jit(model.apply)(params, x), reference(kind, params, x))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_linen_scaled_weight_grads_are_its_quantized_gemms(remat):
  """Under grad (and remat): the weight's and its scale's gradients come from the
  quantized GEMM of the scaled weight."""
  x, kind = inputs(), "one_plus"
  model = jqf.quantize_model(LinenBlock(kind, remat), RECIPE)
  params = jax.jit(model.init)(jax.random.key(0), x)
  loss = lambda apply: lambda p: jnp.sum(apply(p) ** 2)
  got = jax.jit(jax.grad(loss(lambda p: model.apply(p, x))))(params)
  want = jax.jit(jax.grad(loss(lambda p: reference(kind, p, x))))(params)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  plain = jax.jit(jax.grad(loss(lambda p: LinenBlock(kind).apply(p, x))))(params)
  assert not np.array_equal(got["params"]["proj"]["w"], plain["params"]["proj"]["w"])


class ScannedLayer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    w = self.param("w", nn.initializers.normal(0.05), (D, D))
    return jnp.einsum("bd,de->be", h, w * self.param("w_scale", scale_init, (D,))), None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    layers = nn.scan(
      ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )
    return layers(name="layers")(x, None)[0]


def test_linen_scanned_scaled_weights_are_their_weight_gemms():
  """`nn.scan` traces its body twice, first by partial evaluation (tracers that record
  their equation as a `recipe`): the weight is found in both."""
  x = inputs()
  model = jqf.quantize_model(Scanned(), RECIPE)
  params = jax.jit(model.init)(jax.random.key(0), x)
  rows = jqf.swap_report(model, params, x).rows
  assert rows and {(r.role, r.status) for r in rows} == {("layers/w", sessions.QUANTIZED)}
  p, h = params["params"]["layers"], x
  for i in range(2):
    h = ops.dense(h, p["w"][i] * p["w_scale"][i], recipe=RECIPE, name="layers/w")
  np.testing.assert_array_equal(jax.jit(model.apply)(params, x), h)


class NnxScaledEinsum(nnx.Module):
  def __init__(self, kind, rngs):
    self.kind = kind
    self.w = nnx.Param(nn.initializers.normal(0.05)(rngs.params(), (D, F)))
    for name, shape in scale_shapes(kind).items():
      setattr(self, name, nnx.Param(scale_init(rngs.params(), shape)))

  def __call__(self, x):
    scales = {n: getattr(self, n)[...] for n in scale_shapes(self.kind)}
    return jnp.einsum("bd,df->bf", x, scaled(self.kind, self.w[...], scales))


class NnxBlock(nnx.Module):
  def __init__(self, kind, rngs):
    self.proj = NnxScaledEinsum(kind, rngs)

  def __call__(self, x):
    return self.proj(x)


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_scaled_weight_is_its_weight_gemm(kind):
  x = inputs()
  model = jqf.quantize_model(NnxBlock(kind, nnx.Rngs(0)), RECIPE)
  assert_quantized_as(jqf.swap_report(model, x), "proj/w")
  p = model.proj
  w = scaled(kind, p.w[...], {n: getattr(p, n)[...] for n in scale_shapes(kind)})
  want = ops.dense(x, w, recipe=RECIPE, name="proj/w")
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(model, x), want)


# ---- What the walk must not take as a weight ----


class MixesActivations(nn.Module):
  """A scaled weight's GEMM, then products of activations with a weight-shaped param:
  `(h * g) @ v` (v is the weight, h * g an activation) and `h * g` contracted with h."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, F))
    h = jnp.einsum("bd,df->bf", x, w * self.param("w_scale", scale_init, (F,)))
    g = self.param("g", nn.initializers.normal(1.0), (B, F))
    v = self.param("v", nn.initializers.normal(0.05), (F, F))
    return jnp.einsum("bf,fg->bg", h * g, v) + jnp.einsum("bf,cf->bc", h * g, h)


def test_an_operand_mixing_in_activations_is_no_weight():
  x = inputs()
  model = jqf.quantize_model(MixesActivations(), RECIPE)
  params = jax.jit(model.init)(jax.random.key(0), x)
  rows = jqf.swap_report(model, params, x).rows
  assert [(r.role, r.status) for r in rows[:2]] == [
    ("w", sessions.QUANTIZED),
    ("v", sessions.QUANTIZED),
  ]
  assert rows[2].role is None and rows[2].status.startswith(sessions.NOT_A_WEIGHT_GEMM)


# ---- The walk itself: what it matches, and why a weight-like operand is not matched ----


def traced(fn, params, *args):
  """`provenance.trace_operand(fn(params, *args), params)` inside a jit trace."""
  out = []

  def run(params, *args):
    out.append(provenance.trace_operand(fn(params, *args), params))
    return 0

  jax.jit(run)(params, *args)
  return out[0]


PARAMS = {
  name: jax.random.normal(jax.random.key(i), shape)
  for i, (name, shape) in enumerate({"w": (D, F), "w2": (D, F), "s": (F,), "u": (D,)}.items())
}


@pytest.mark.parametrize(
  "fn",
  [
    lambda p, x: p["w"] * p["s"],
    lambda p, x: (p["w"] * (1 + p["s"]) / 2.0).astype(jnp.bfloat16).T,
    lambda p, x: jnp.where(CHANNEL_SCALE > 1, p["w"], -p["w"]),
    lambda p, x: jax.nn.relu(jnp.clip(p["w"] * p["s"], -1, 1)),
    lambda p, x: p["w"] * jnp.arange(F, dtype=jnp.float32),
  ],
)
def test_a_weight_transformed_by_params_and_constants_is_that_weight(fn):
  found = traced(fn, PARAMS, inputs())
  assert (found.label, found.unresolved) == ("w", None)


@pytest.mark.parametrize(
  "fn, reason",
  [
    (lambda p, x: p["w"] + p["w2"], "'w' and 'w2'"),
    (lambda p, x: p["u"][:, None] * p["s"][None, :], "none of them"),
    (lambda p, x: p["w"][:, : F // 2], "none of them"),
    (lambda p, x: p["w"] * jnp.mean(x), "not its module's params"),
    (lambda p, x: x.T * p["w"], "not its module's params"),
  ],
)
def test_a_weight_like_operand_not_matched_says_why(fn, reason):
  found = traced(fn, PARAMS, inputs())
  assert found.label is None and reason in found.unresolved


def test_activations_scaled_by_a_param_are_no_weight_and_no_question():
  found = traced(lambda p, x: x * p["u"], PARAMS, inputs())
  assert (found.label, found.unresolved) == (None, None)


def test_eagerly_a_scaled_weight_is_unresolved_with_its_reason():
  """Eager values keep no history: only a param's own values (cast, viewed) match."""
  found = provenance.trace_operand(PARAMS["w"] * PARAMS["s"] * 2, PARAMS)
  assert found.label is None and "eager" in found.unresolved and "'w'" in found.unresolved
  assert provenance.trace_operand(PARAMS["w"].T.astype(jnp.bfloat16), PARAMS).label == "w"
