"""MaxText's `quant=` protocol as MaxText 0.2.5 calls it, on a small model in its style.

MaxText's NNX `DenseGeneral` asks `quant.dot_general_cls(mesh_axes=...)()` for a Linen
module, bridges it alone into NNX (`ToNNX`, so the module's own path is empty), builds it
in its `__init__` with a dummy input, calls it with `mutable=["aqt"]`, reads
`quant.quant_mode` and `quant.needs_apply_rngs`, and gives `logits_dense` no `quant`.
Its train step differentiates the params and the `_overwrite_with_gradient` variables
and overwrites the latter with their gradient.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

D, FF, VOCAB, TOKENS = 32, 64, 64, (2, 32)
OWG = "_overwrite_with_gradient"


class ToNNX(nnx.bridge.ToNNX):
  """MaxText 0.2.5's `nnx_wrappers.ToNNX` where it differs from Flax's: when applied, it
  hands the Linen module the bridge's Variables alone (plain attributes, such as Qwix's
  bookkeeping or the swap-in's names, stay on the bridge), each boxed with its NNX
  metadata (`NNXMeta`); and it drops its Rngs on request."""

  def release_rngs(self):
    self.to_nnx__rngs = None

  def __call__(self, *args, mutable=None, **kwargs):
    if self._pytree__state.initializing:
      return super().__call__(*args, **kwargs)
    attrs = {k: v for k, v in vars(self).items() if not k.startswith(("to_nnx__", "_pytree__"))}
    variables = {
      (nnx.variablelib.variable_name_from_type(type(v)), *path): nnx.bridge.NNXMeta(
        type(v), v.get_value(), v.get_metadata()
      )
      for path, v in nnx.traversals.flatten_mapping(attrs).items()
      if isinstance(v, nnx.Variable)
    }
    rngs = self.to_nnx__rngs
    out, updates = self.to_nnx__module.apply(
      nnx.traversals.unflatten_mapping(variables),
      *args,
      rngs={} if rngs is None else {name: stream() for name, stream in rngs.items()},
      mutable=mutable,
      **kwargs,
    )
    assert not updates  # MaxText writes back "aqt" only, which jaxquant's hooks never make
    return out


def in_serve_mode(quant):
  return quant and quant.quant_mode == "serve"


class DenseGeneral(nnx.Module):
  """MaxText 0.2.5's `linears.DenseGeneral`, one contracted axis."""

  def __init__(self, d_in, d_out, quant=None, *, rngs, matmul_precision="default"):
    self.kernel = nnx.Param(nn.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))
    self.quant = quant
    self.dtype = jnp.bfloat16
    self.matmul_precision = matmul_precision
    if quant:
      dot_general_linen = quant.dot_general_cls(mesh_axes=("embed", "mlp"))()
      quant_dot_general = ToNNX(dot_general_linen, rngs=rngs)
      self._quant_dot_general_name = f"{type(dot_general_linen).__name__}_0"
      setattr(self, self._quant_dot_general_name, quant_dot_general)
      block_size = getattr(quant, "get_block_size", lambda: 1)()
      self(jnp.zeros((block_size, d_in), self.dtype), _initializing=True)
      if not quant.needs_apply_rngs:
        quant_dot_general.release_rngs()
    else:
      self._quant_dot_general_name = None

  def __call__(self, inputs, _initializing=False):
    inputs = jnp.asarray(inputs, self.dtype)
    assert not in_serve_mode(self.quant)
    kernel = jnp.asarray(self.kernel[...], self.dtype)
    dims = (((inputs.ndim - 1,), (0,)), ((), ()))
    if self._quant_dot_general_name is not None:
      quant_dot_general = getattr(self, self._quant_dot_general_name)
      if _initializing:
        quant_dot_general.lazy_init(inputs, kernel, dims, precision=None)
      return quant_dot_general(inputs, kernel, dims, precision=None, mutable=["aqt"])
    precision = jax.lax.Precision(self.matmul_precision)
    return jax.lax.dot_general(inputs, kernel, dims, precision=precision)


class Mlp(nnx.Module):
  def __init__(self, quant, rngs, precision="default"):
    dense = lambda d_in, d_out: DenseGeneral(
      d_in, d_out, quant, rngs=rngs, matmul_precision=precision
    )
    self.wi_0 = dense(D, FF)
    self.wi_1 = dense(D, FF)
    self.wo = dense(FF, D)

  def __call__(self, x):
    return self.wo(jax.nn.silu(self.wi_0(x)) * self.wi_1(x))


class Layer(nnx.Module):
  def __init__(self, quant, rngs, precision="default"):
    self.mlp = Mlp(quant, rngs, precision)

  def __call__(self, x):
    return x + self.mlp(x)


def scanned_layers(quant, rngs, length):
  """MaxText's `nnx_scan.create_scanned_layers`: the layers built in a `lax.scan`, their
  variables stacked."""
  rngs_graphdef, rngs_state = nnx.split(rngs.split(length))
  reference = Layer(quant, nnx.merge(rngs_graphdef, jax.tree.map(lambda x: x[0], rngs_state)))
  graphdef, _, _ = nnx.split(reference, nnx.Param, ...)

  def build(carry, rng_state):
    _, params, rest = nnx.split(Layer(quant, nnx.merge(rngs_graphdef, rng_state)), nnx.Param, ...)
    return carry, (params, rest)

  _, (params, rest) = jax.lax.scan(build, None, rngs_state)
  return nnx.merge(graphdef, params, rest)


def apply_scanned_layers(layers, x):
  """MaxText's `nnx_scan.apply_scanned_layers`, rematerialized: each layer merged in the
  scan body, its non-param state written back."""
  graphdef, params, rest = nnx.split(layers, nnx.Param, ...)

  def body(carry, state):
    layer = nnx.merge(graphdef, *state)
    carry = layer(carry)
    return carry, nnx.split(layer, nnx.Param, ...)[2]

  x, rest = jax.lax.scan(jax.checkpoint(body), x, (params, rest))
  nnx.update(layers, rest)
  return x


class Decoder(nnx.Module):
  """MaxText's NNXDecoder: one unscanned layer `layers_0`, or two scanned `layers`, and
  `logits_dense` without `quant`."""

  def __init__(self, quant, rngs, scanned, precision="default"):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    if scanned:
      self.layers = scanned_layers(quant, rngs, 2)
    else:
      self.layers_0 = Layer(quant, rngs, precision)
    self.logits_dense = DenseGeneral(D, VOCAB, rngs=rngs, matmul_precision=precision)
    self.scanned = scanned

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    x = apply_scanned_layers(self.layers, x) if self.scanned else self.layers_0(x)
    return self.logits_dense(x).astype(jnp.float32)


class Transformer(nnx.Module):
  def __init__(self, quant=None, seed=0, scanned=False, matmul_precision="default"):
    # MaxText's training Rngs: "aqt" is the stream its quantizations draw from.
    rngs = nnx.Rngs(params=seed, dropout=seed + 1, aqt=seed + 2)
    self.decoder = Decoder(quant, rngs, scanned, matmul_precision)

  def __call__(self, tokens):
    return self.decoder(tokens)


def hooked(scanned):
  """The roles of the layers MaxText gives `quant=`: their paths."""
  layers = "decoder/layers" if scanned else "decoder/layers_0"
  return tuple(f"{layers}/mlp/{n}" for n in ("wi_0", "wi_1", "wo"))


TOKEN_DATA = jax.random.randint(jax.random.key(7), TOKENS, 0, VOCAB)


def loss_fn(model, tokens=TOKEN_DATA):
  logits = model(tokens)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))


def quantize(model, recipe):
  """What a MaxText user does with the built model: `quantize_model` names its layers and
  quantizes the contractions MaxText gives no `quant=` (logits_dense)."""
  return jqf.quantize_model(model, recipe, rngs=nnx.Rngs(quant=3))


@pytest.fixture(scope="module")
def built():
  """`built(scanned)`: a model given `quant=MaxTextQuantization()` (its hooks take the
  model's recipe), built once; each test quantizes a clone."""
  models = {}

  def get(scanned=False):
    if scanned not in models:
      models[scanned] = Transformer(jqf.MaxTextQuantization(), scanned=scanned)
    return nnx.clone(models[scanned])

  return get


def train(model, steps, lr=0.05):
  """MaxText's NNX train step, `steps` times: grads of the params and of the
  _overwrite_with_gradient variables; params by SGD, the others overwritten by their
  gradient. Returns the losses."""
  owg = nnx.variablelib.variable_type_from_name(OWG, allow_register=True)
  graphdef, params, custom, rest = nnx.split(model, nnx.Param, owg, ...)

  @jax.jit
  def step(params, custom):
    loss = lambda params, custom: loss_fn(nnx.merge(graphdef, params, custom, rest, copy=True))
    value, (grads, custom_grads) = jax.value_and_grad(loss, argnums=(0, 1))(params, custom)
    return value, jax.tree.map(lambda p, g: p - lr * g, params, grads), custom_grads

  losses = []
  for _ in range(steps):
    value, params, custom = step(params, custom)
    losses.append(float(value))
  nnx.update(model, params, custom)
  return losses


@pytest.mark.parametrize("recipe", [recipes.fp8_current, recipes.mxfp8, recipes.nvfp4])
def test_runs_quantized(built, recipe):
  model = quantize(built(), recipe)
  value = nnx.jit(loss_fn)(model)
  assert np.isfinite(value) and value != loss_fn(Transformer())
  report = jqf.swap_report(model, TOKEN_DATA)
  assert {r.role for r in report.quantized} == set(hooked(False)) | {"decoder/logits_dense"}


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
def test_roles_are_layer_paths_and_a_policy_holds(built, scanned):
  roles = hooked(scanned)
  wo = roles[-1]  # kept in bf16 by the policy
  seen = set()

  def policy(role):
    seen.add(role.name)
    return None if role.name == wo else recipes.fp8_current_factory(role)

  report = jqf.swap_report(quantize(built(scanned), recipes.CustomRecipe(policy)), TOKEN_DATA)
  assert {r.role for r in report.quantized} == set(roles[:-1]) | {"decoder/logits_dense"}
  assert wo in {r.role for r in report.high_precision}
  assert set(roles) <= seen


def role_states(tree):
  leaves = jax.tree.leaves(tree, is_leaf=jqf.is_role_state)
  return [leaf for leaf in leaves if jqf.is_role_state(leaf)]


def _owg_states(model):
  owg = nnx.variablelib.variable_type_from_name(OWG, allow_register=True)
  leaves = jax.tree.leaves(nnx.state(model, owg), is_leaf=lambda x: isinstance(x, jqf.RoleState))
  return [leaf for leaf in leaves if isinstance(leaf, jqf.RoleState)]


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
def test_fp8_delayed_state_advances_in_maxtexts_train_step(scanned):
  recipe = recipes.fp8_delayed
  model = quantize(Transformer(jqf.MaxTextQuantization(recipe), scanned=scanned), recipe)
  # logits_dense is contracted by MaxText's own code (no quant=), routed by quantize_model;
  # its state sits beside the hooks' in _overwrite_with_gradient.
  roles = set(hooked(scanned)) | {"decoder/logits_dense"}
  # Differentiating the params alone would leave the scales as they are: a warning says
  # so, once for each GEMM of the model, not again at the next trace.
  for traces, expected in ((1, roles), (2, set())):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      nnx.eval_shape(nnx.grad(loss_fn), model)
    named = [str(w.message).split("'")[1] for w in caught if "will not advance" in str(w.message)]
    assert sorted(named) == sorted(expected), traces
  # The routed GEMM's state is made at its first call: one before MaxText's step, which
  # keeps nothing the step adds to the model.
  assert not hasattr(model.decoder.logits_dense, "kernel_quant_state")
  nnx.jit(loss_fn)(model)
  before = _owg_states(model)
  assert len(before) == 3 * len(roles)
  assert {s.role.name for s in before} == {"", "decoder/logits_dense"}  # hooks': made unnamed
  assert all(np.all(s.scaling.scale == 1) for s in before)
  losses = train(model, steps=3)
  assert np.all(np.isfinite(losses))
  for state in _owg_states(model):  # each layer's own (scanned: stacked along axis 0)
    assert np.all(np.any(state.scaling.amax_history != 0, axis=-1)), state.role
    assert np.all(state.scaling.scale != 1), state.role
    assert np.all(np.isfinite(state.scaling.scale)), state.role


def train_advancing_quant_state(model, steps, lr=0.05):
  """MaxText's NNX train step (`train`) with what docs/flax.md ("MaxText") adds for a model
  quantized by `quantize_model` alone: its `QuantState`s split off and differentiated, their
  forward value returned by the loss, and `update_quant_state` of the two written back."""
  owg = nnx.variablelib.variable_type_from_name(OWG, allow_register=True)
  graphdef, params, custom, quant_state, rest = nnx.split(
    model, nnx.Param, owg, jqf.QuantState, ...
  )

  @jax.jit
  def step(params, custom, quant_state):
    def diff_wrapper(params, custom, quant_state):
      local_model = nnx.merge(graphdef, params, custom, quant_state, rest, copy=True)
      return loss_fn(local_model), nnx.state(local_model, jqf.QuantState)

    grad_func = jax.value_and_grad(diff_wrapper, argnums=(0, 1, 2), has_aux=True)
    (value, forward_state), (grads, custom_grads, state_grads) = grad_func(
      params, custom, quant_state
    )
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return value, params, custom_grads, jqf.update_quant_state(forward_state, state_grads)

  losses = []
  for _ in range(steps):
    value, params, custom, quant_state = step(params, custom, quant_state)
    losses.append(float(value))
  nnx.update(model, params, custom, quant_state)
  return losses


def test_quantize_model_alone_advances_its_state_in_the_train_step_docs_give():
  """Built without `quant=`, every GEMM of the model is routed by `quantize_model`, its
  state a `QuantState` (made at the first call): MaxText's step as it is never advances
  it, the step docs/flax.md gives does."""
  model = quantize(Transformer(), recipes.fp8_delayed)
  nnx.jit(loss_fn)(model)  # the routed GEMMs make their states at their first call
  roles = {f"decoder/layers_0/mlp/{n}" for n in ("wi_0", "wi_1", "wo")} | {"decoder/logits_dense"}
  states = lambda: role_states(nnx.state(model, jqf.QuantState))
  assert {s.role.name for s in states()} == roles and len(states()) == 3 * len(roles)
  assert not _owg_states(model)
  unadvanced = nnx.clone(model)
  assert np.all(np.isfinite(train(unadvanced, steps=2)))
  for state in role_states(nnx.state(unadvanced, jqf.QuantState)):
    assert np.all(state.scaling.scale == 1), state.role
  losses = train_advancing_quant_state(model, steps=3)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  for state in states():
    assert np.all(np.any(state.scaling.amax_history != 0, axis=-1)), state.role
    assert np.all(state.scaling.scale != 1), state.role
    assert np.all(np.isfinite(state.scaling.scale)), state.role


def test_bf16_is_the_plain_model(built):
  plain = Transformer()
  model = quantize(built(), recipes.bf16)
  nnx.update(model, nnx.state(plain, nnx.Param))
  value, grads = nnx.value_and_grad(loss_fn)(model)
  plain_value, plain_grads = nnx.value_and_grad(loss_fn)(plain)
  assert value == plain_value
  jax.tree.map(np.testing.assert_array_equal, grads, plain_grads)


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_bf16_keeps_the_layers_matmul_precision(precision):
  """MaxText hands its quantization precision=None and keeps `matmul_precision` for its
  plain dot_general: under bf16 every GEMM compiles as the plain model's does."""
  plain = Transformer(matmul_precision=precision)
  quant = jqf.MaxTextQuantization()
  model = quantize(Transformer(quant, matmul_precision=precision), recipes.bf16)
  nnx.update(model, nnx.state(plain, nnx.Param))
  lowered = lambda model: nnx.jit(nnx.value_and_grad(loss_fn)).lower(model).as_text()
  text = lowered(model)
  # The same GEMMs: operand shapes, dimensions and precision, in the same order (the
  # value names differ: the quantized model's graph holds the bridges' Rngs too).
  gemms = lambda text: [
    re.sub(r"%[\w#]+", "%", line) for line in text.splitlines() if "dot_general" in line
  ]
  assert len(gemms(text)) == 4 * 3  # 4 GEMMs, a forward and two backward each
  assert all(f"precision = [{precision.upper()}, {precision.upper()}]" in g for g in gemms(text))
  assert gemms(text) == gemms(lowered(plain))


def test_unnamed_layer_is_an_error():
  """Without quantize_model nothing names MaxText's layers: no role could match a policy."""
  model = Transformer(jqf.MaxTextQuantization(recipes.fp8_current))
  with pytest.raises(ValueError, match="quantize_model"):
    loss_fn(model)


class MoeLike(nnx.Module):
  """MaxText's MoE: weights it names itself (`wi`, `wo`), contracted through
  `quant.einsum(mesh_axes=...)` bridged on first use (`quantizations.apply_einsum_in_nnx`)."""

  def __init__(self, quant, rngs):
    init = nn.initializers.lecun_normal()
    self.wi = nnx.Param(init(rngs.params(), (D, FF)))
    self.wo = nnx.Param(init(rngs.params(), (FF, D)))
    self.quant = quant
    self.rngs = rngs

  def einsum(self, op_id, equation, x, kernel):
    attr = f"quant_einsum_{op_id}"
    bridge = getattr(self, attr, None)
    if bridge is None:
      bridge = ToNNX(self.quant.einsum(mesh_axes=("embed", "mlp")), rngs=self.rngs)
      bridge.lazy_init(equation, x, kernel)
      setattr(self, attr, bridge)
    return bridge(equation, x, kernel, mutable=["aqt"])

  def __call__(self, x):
    wi, wo = (jnp.asarray(w[...], jnp.bfloat16) for w in (self.wi, self.wo))
    h = self.einsum("wi", "btd,df->btf", x, wi)
    return self.einsum("wo", "btf,fd->btd", jax.nn.silu(h), wo)


class MoeModel(nnx.Module):
  def __init__(self, quant):
    self.moe = MoeLike(quant, nnx.Rngs(params=0, aqt=1))

  def __call__(self, tokens):
    return self.moe(jax.nn.one_hot(tokens, D, dtype=jnp.bfloat16)).astype(jnp.float32)


def test_einsum_roles_are_the_params_paths():
  """A layer contracting several weights through `quant.einsum` gets a role for each."""
  model = quantize(MoeModel(jqf.MaxTextQuantization(recipes.fp8_current)), recipes.fp8_current)
  report = jqf.swap_report(model, TOKEN_DATA)
  assert {r.role for r in report.quantized} == {"moe/wi", "moe/wo"}
