"""jaxquant.analysis.sensitivity and suggest_recipe on small Linen and NNX models.

The models are three-GEMM residual nets (up, down, head; every GEMM 64x64, so one
compiled quantized GEMM serves all three) whose `down` layer takes an input with a few
planted outlier channels, as the massive activations of trained transformers: those
channels are GAIN times larger, and `down`'s kernel rows for them GAIN times smaller, so
the model computes the same function as without them. A format with too little dynamic
range per scale (NVFP4's 16-element blocks, per-tensor FP8 at a larger gain)
flushes the other channels of `down`'s input, which then ranks first.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import analysis, recipes
from jaxquant.quantizers import Float8Quantizer
from jaxquant.roles import QuantizerRole

WIDTH, VOCAB, BATCH, SEQ = 64, 64, 4, 16  # 64 tokens: every NVFP4 / RHT block fits
OUTLIER_CHANNELS = np.array([5, 22, 41])  # one per 16-channel NVFP4 block of down's input
MODULES = ("up", "down", "head")
# Outlier gains: past the range of one per-tensor FP8 scale (448 / 2^-9 ~ 2e5), and of
# one NVFP4 block scale (6 / 0.5 = 12) with room to spare.
GAIN_FP8, GAIN_NVFP4 = 1e6, 100.0


def channel_gains(gain: float) -> np.ndarray:
  gains = np.ones(WIDTH, np.float32)
  gains[OUTLIER_CHANNELS] = gain
  return gains


def compensated_init(gains: np.ndarray):
  """lecun_normal with row k divided by gains[k]: undoes the planted input gains."""

  def init(key, shape, dtype=jnp.float32):
    return nn.initializers.lecun_normal()(key, shape, dtype) / jnp.asarray(gains, dtype)[:, None]

  return init


class LinenNet(nn.Module):
  gain: float

  @nn.compact
  def __call__(self, tokens):
    gains = channel_gains(self.gain)
    dense = lambda name, **kw: nn.Dense(WIDTH, dtype=jnp.bfloat16, name=name, **kw)
    x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens).astype(jnp.bfloat16)
    h = nn.gelu(dense("up")(x)) * jnp.asarray(gains, jnp.bfloat16)
    x = x + dense("down", kernel_init=compensated_init(gains))(h)
    return dense("head")(x).astype(jnp.float32)


class NnxNet(nnx.Module):
  def __init__(self, gain: float, rngs: nnx.Rngs):
    self.gains = nnx.Variable(jnp.asarray(channel_gains(gain), jnp.bfloat16))
    linear = lambda **kw: nnx.Linear(WIDTH, WIDTH, dtype=jnp.bfloat16, rngs=rngs, **kw)
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.up = linear()
    self.down = linear(kernel_init=compensated_init(channel_gains(gain)))
    self.head = linear()

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    h = nn.gelu(self.up(x)) * self.gains[...]
    x = x + self.down(h)
    return self.head(x).astype(jnp.float32)


def next_token_loss(call, windows):
  logits = call(windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


WINDOWS = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)


def linen_report(gain: float, recipe, **kwargs):
  model = LinenNet(gain)
  variables = model.init(jax.random.key(0), WINDOWS[:, :-1])
  return analysis.sensitivity(model, variables, WINDOWS, recipe, next_token_loss, **kwargs)


@pytest.fixture(scope="module")
def fp8_report():
  return linen_report(GAIN_FP8, recipes.fp8_current, model_runs=None)


def test_linen_fp8_ranks_the_module_with_outlier_inputs_first(fp8_report):
  assert [m.name for m in fp8_report.modules][0] == "down"
  down = fp8_report.module("down")
  # Its input role alone is what loses the signal: the non-outlier channels flush to 0.
  worst_role = min(down.roles, key=lambda r: r.worst_sqnr_db)
  assert worst_role.role.tensor_type == "input"
  assert worst_role.gemm_sqnr_db["fprop"] < 3
  others = [fp8_report.module(name).worst_sqnr_db for name in ("up", "head")]
  assert min(others) > 20 and down.worst_sqnr_db < min(others) - 10


def test_without_outliers_down_is_like_up():
  """The control: the same net without planted outliers (up and down alike: same shapes)."""
  report = linen_report(1.0, recipes.fp8_current, model_runs=None)
  assert abs(report.module("down").worst_sqnr_db - report.module("up").worst_sqnr_db) < 1
  assert min(m.worst_sqnr_db for m in report.modules) > 20
  assert all(m.model is None for m in report.modules)


def test_suggested_recipe_keeps_the_top_module_in_bf16(fp8_report):
  suggested = analysis.suggest_recipe(fp8_report, recipes.fp8_current, keep_high_precision=1)
  for tensor_type in ("input", "weight", "grad_output"):
    assert suggested.quantizer(QuantizerRole("linear", tensor_type, "down")) is None
    for name in ("up", "head"):
      role = QuantizerRole("linear", tensor_type, name)
      assert suggested.quantizer(role) == recipes.fp8_current.quantizer(role)
  assert suggested.qfactory.kept == {("linear", "down")}
  settings = lambda r: (r.backward, r.fast_accumulation, r.tiny_gemms_in_high_precision)
  assert settings(suggested) == settings(recipes.fp8_current)
  with pytest.raises(ValueError, match="keep_high_precision=4"):
    analysis.suggest_recipe(fp8_report, recipes.fp8_current, keep_high_precision=4)


def _module(name: str, worst_sqnr_db: float, loss_change=None) -> analysis.ModuleSensitivity:
  effect = (
    None
    if loss_change is None
    else analysis.ModelEffect(
      loss=1.0 + loss_change,
      grad_norm=1.0,
      loss_change=loss_change,
      grad_norm_change=0.0,
      grad_error=0.1,
    )
  )
  sqnr = {"fprop": worst_sqnr_db, "dgrad": worst_sqnr_db + 1, "wgrad": worst_sqnr_db + 2}
  return analysis.ModuleSensitivity("linear", name, sqnr, (), effect)


def test_suggest_ranks_by_loss_change_when_asked():
  """rank_by="loss_change" keeps the modules whose quantization raises the loss most,
  whatever their GEMM SQNRs; it refuses a report measured without model runs."""
  report = analysis.SensitivityReport(
    "fp8_current",
    1.0,
    1.0,
    (
      _module("early", 10.0, loss_change=0.001),
      _module("middle", 15.0, loss_change=-0.002),
      _module("late", 25.0, loss_change=0.03),
    ),
  )
  by_loss = analysis.ranked_modules(report, "loss_change")
  assert [m.name for m in by_loss] == ["late", "early", "middle"]
  assert [m.name for m in analysis.ranked_modules(report)] == ["early", "middle", "late"]
  for rank_by, kept in (("loss_change", {"late", "early"}), ("gemm_sqnr", {"early", "middle"})):
    suggested = analysis.suggest_recipe(
      report, recipes.fp8_current, keep_high_precision=2, rank_by=rank_by
    )
    assert {name for _, name in suggested.qfactory.kept} == kept
  without = analysis.SensitivityReport(
    "fp8_current", 1.0, 1.0, (_module("early", 10.0, loss_change=0.001), _module("late", 25.0))
  )
  with pytest.raises(ValueError, match="late lack: measure with sensitivity"):
    analysis.suggest_recipe(
      without, recipes.fp8_current, keep_high_precision=1, rank_by="loss_change"
    )
  with pytest.raises(ValueError, match="rank_by must be one of"):
    analysis.ranked_modules(report, "grad_error")


def test_report_table_ranks_as_asked():
  """The table lists the modules in the order that chose the suggestion."""
  report = analysis.SensitivityReport(
    "fp8_current",
    1.0,
    1.0,
    (
      _module("early", 10.0, loss_change=0.001),
      _module("middle", 15.0, loss_change=-0.002),
      _module("late", 25.0, loss_change=0.03),
    ),
  )
  for rank_by, order in (
    ("gemm_sqnr", ["early", "middle", "late"]),
    ("loss_change", ["late", "early", "middle"]),
  ):
    table = report.table(rank_by)
    assert [table.index(f"| {rank} | {name} |") for rank, name in enumerate(order, 1)] == sorted(
      table.index(f"| {rank} | {name} |") for rank, name in enumerate(order, 1)
    )
  assert "ranked by the change of the model's loss" in report.table("loss_change")
  assert "ranked by the worst SQNR" in report.table()


def test_report_table_lists_every_module_and_role(fp8_report):
  table = fp8_report.table()
  for name in MODULES:
    assert f"| {name} |" in table
  assert table.index("| 1 | down |") < table.index("| 2 |")
  assert sum(line.startswith("| down | ") for line in table.splitlines()) == 3  # its roles


class OneDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, dtype=jnp.bfloat16, use_bias=False, name="layer")(x)


class OneLinear(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.layer = nnx.Linear(64, 32, dtype=jnp.bfloat16, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.layer(x)


E4M3 = recipes.CustomRecipe(lambda role: Float8Quantizer("e4m3"), name="e4m3")
# Inputs whose columns span 300x: per-tensor E4M3 rounds the small ones coarsely.
ONE_LAYER_X = jax.random.normal(jax.random.key(2), (64, 64)) * jnp.linspace(0.1, 30, 64)


def half_sum_of_squares(call, x):
  return 0.5 * jnp.sum(jnp.square(call(x).astype(jnp.float32)))


def norm(tree) -> float:
  return float(
    jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree)))
  )


@pytest.fixture(scope="module")
def one_dense():
  model = OneDense()
  variables = model.init(jax.random.key(3), ONE_LAYER_X)
  report = analysis.sensitivity(model, variables, ONE_LAYER_X, E4M3, half_sum_of_squares)
  return model, variables["params"], report


def test_gemm_sqnr_matches_an_independent_fp8_computation(one_dense):
  """Input role alone under FP8 E4M3 current scaling, fprop: q(x) @ w against x @ w."""
  _, params, report = one_dense
  input_role = next(r for r in report.roles if r.role.tensor_type == "input")
  xb = np.asarray(ONE_LAYER_X.astype(jnp.bfloat16)).astype(np.float64)
  w = np.asarray(jnp.asarray(params["layer"]["kernel"], jnp.bfloat16)).astype(np.float64)
  scale = np.float32(448) / np.float32(np.abs(xb).max())
  xq = (xb * scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / scale
  reference, quantized = xb @ w, xq @ w
  expected = 10 * np.log10(np.sum(reference**2) / np.sum((quantized - reference) ** 2))
  # The quantized GEMM's output is rounded to bf16 (x's dtype): a little more noise.
  assert expected - 0.3 < input_role.gemm_sqnr_db["fprop"] <= expected + 0.01
  # dy = y (the loss is half the sum of squares): dgrad sees no input quantization.
  assert input_role.gemm_sqnr_db["dgrad"] > 40


def test_linen_model_level_effect_is_the_swap_ins(one_dense):
  """The report's loss and gradient figures against quantize_model's, computed here."""
  model, params, report = one_dense

  def loss_and_grads(module):  # jitted, as the analysis: XLA may fuse the bf16 output's cast
    return jax.jit(
      jax.value_and_grad(
        lambda p: half_sum_of_squares(lambda x: module.apply({"params": p}, x), ONE_LAYER_X)
      )
    )(params)

  loss, grads = loss_and_grads(model)
  loss_q, grads_q = loss_and_grads(jqf.quantize_model(model, E4M3))
  assert_effect(report, float(loss), grads, float(loss_q), grads_q)


def assert_effect(report, loss, grads, loss_q, grads_q):
  assert (report.loss, report.grad_norm) == pytest.approx((loss, norm(grads)), rel=1e-6)
  effect = report.module("layer").model
  assert effect.loss == pytest.approx(loss_q, rel=1e-6) and effect.loss != report.loss
  assert effect.grad_norm == pytest.approx(norm(grads_q), rel=1e-5)
  error = norm(jax.tree.map(jnp.subtract, grads_q, grads)) / norm(grads)
  assert effect.grad_error == pytest.approx(error, rel=1e-4) and error > 0


def test_nnx_model_level_effect_is_the_swap_ins():
  @nnx.jit
  def loss_and_grads(module):
    return nnx.value_and_grad(lambda m: half_sum_of_squares(m, ONE_LAYER_X))(module)

  model = OneLinear(nnx.Rngs(3))
  report = analysis.sensitivity(model, None, ONE_LAYER_X, E4M3, half_sum_of_squares)
  loss, grads = loss_and_grads(model)
  quantized = jqf.quantize_model(nnx.clone(model), E4M3)
  loss_q, grads_q = loss_and_grads(quantized)
  assert_effect(report, float(loss), grads, float(loss_q), grads_q)


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_nnx_nvfp4_ranks_the_module_with_outlier_inputs_first():
  model = NnxNet(GAIN_NVFP4, nnx.Rngs(0))
  before = nnx.state(model)
  report = analysis.sensitivity(
    model, None, WINDOWS, recipes.nvfp4, next_token_loss, model_runs=None
  )
  names = [m.name for m in report.modules]
  assert names[0] == "down" and sorted(names) == sorted(MODULES)
  down, others = report.module("down"), [report.module(n) for n in ("up", "head")]
  assert down.gemm_sqnr_db["fprop"] < min(o.gemm_sqnr_db["fprop"] for o in others) - 6
  # RHT on input's columnwise usage pairs it with grad_output's for wgrad.
  input_role = next(r for r in down.roles if r.role.tensor_type == "input")
  assert set(input_role.quantized_with) == {"grad_output"}
  suggested = analysis.suggest_recipe(report, recipes.nvfp4, keep_high_precision=1)
  assert suggested.quantizer(QuantizerRole("linear", "weight", "down")) is None
  assert suggested.quantizer(QuantizerRole("linear", "weight", "up")) is not None
  # The caller's model is untouched: still Flax's own layers, same values.
  assert type(model.down) is nnx.Linear
  jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model))


def test_bad_inputs_are_refused():
  model = OneDense()
  x = jnp.ones((16, 64))
  variables = model.init(jax.random.key(0), x)
  loss = lambda call, batch: jnp.sum(call(batch))
  with pytest.raises(ValueError, match="quantizes none"):
    analysis.sensitivity(model, variables, x, recipes.bf16, loss)
  with pytest.raises(ValueError, match="model_runs"):
    analysis.sensitivity(model, variables, x, recipes.fp8_current, loss, model_runs="layer")
  with pytest.raises(ValueError, match="scalar"):
    analysis.sensitivity(model, variables, x, recipes.fp8_current, lambda call, b: call(b))
  with pytest.raises(ValueError, match="variables"):
    analysis.sensitivity(model, variables["params"], x, recipes.fp8_current, loss)


class ScannedDenses(nn.Module):
  @nn.compact
  def __call__(self, x):
    step = lambda module, carry, _: (nn.Dense(64, dtype=jnp.bfloat16, name="layer")(carry), None)
    scan = nn.scan(step, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    return scan(self, x, None)[0]


def test_layers_under_scan_are_refused_with_the_way_out():
  model = ScannedDenses()
  x = jnp.ones((16, 64), jnp.bfloat16)
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="unrolled copy"):
    analysis.sensitivity(
      model,
      variables,
      x,
      recipes.fp8_current,
      lambda call, batch: jnp.sum(call(batch)),
      model_runs=None,
    )


class DropoutNet(nnx.Module):
  """An NNX model that draws from its Rngs in the forward, as MaxText's decoder does: an
  active `nnx.Dropout` between its GEMMs."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, WIDTH, dtype=jnp.bfloat16, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(WIDTH, WIDTH, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    return self.head(self.dropout(nn.gelu(self.up(x)))).astype(jnp.float32)


def test_nnx_model_with_active_dropout_is_analysed():
  model = DropoutNet(nnx.Rngs(params=0, dropout=1))
  before = nnx.state(model)
  report = analysis.sensitivity(model, None, WINDOWS, recipes.fp8_current, next_token_loss)
  assert sorted(m.name for m in report.modules) == ["head", "up"]
  assert all(np.isfinite(m.model.loss_change) for m in report.modules)
  suggested = analysis.suggest_recipe(report, recipes.fp8_current, keep_high_precision=1)
  kept = report.modules[0].name
  assert suggested.quantizer(QuantizerRole("linear", "weight", kept)) is None
  # The caller's model, its dropout stream included, is as it was.
  same = lambda a, b: np.testing.assert_array_equal(*map(_raw_key_data, (a, b)))
  jax.tree.map(same, before, nnx.state(model))


def _raw_key_data(x):
  return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
