"""The checks each real model goes through: its swap report, bf16 against the plain model
bit for bit, and a few training steps per recipe against the plain model's.

Linen models (gemma) are quantized by wrapping (`quantize_model` returns a new module
over the same parameters); NNX models (MaxText, EasyDeL) in place, so each NNX run builds
a fresh model and copies the same parameters into it. A failing step is recorded with
its error's first line (`Findings.attempt`) and the other steps still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxquant.flax as jqf

TRAINED_RECIPES = ("fp8_current", "mxfp8", "nvfp4")
STEPS = 4
LEARNING_RATE = 1e-2
# Tiny shapes that every format tiles (MXFP8's 32-element blocks, NVFP4's 16x16 weight
# tiles): 2 x 32 tokens, model width 64, MLP width 128, 2 heads of 32, vocabulary 256.
BATCH, SEQ, WIDTH, MLP, HEADS, HEAD_DIM, VOCAB = 2, 32, 64, 128, 2, 32, 256
# A quantized run "ends near" the plain one when its last loss is within this fraction.
NEAR_PLAIN = 0.05
# GEMMs whose shape a format cannot tile (a 4-expert router) run in high precision and
# are listed with the reason, instead of stopping the model.
ON_UNFIT = "high_precision"


def first_line(error: BaseException) -> str:
  text = f"{type(error).__name__}: {error}".strip()
  return text.splitlines()[0] if text else type(error).__name__


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  logits = logits[:, :-1].astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def report_summary(report: jqf.SwapReport) -> dict:
  """Counts of a swap report: quantized / high precision by reason / no weight GEMM."""
  weights = [r for r in report.rows if r.is_weight_gemm]
  reasons: dict[str, int] = {}
  for row in weights:
    if row not in report.quantized:
      reasons[row.status] = reasons.get(row.status, 0) + 1
  return {
    "quantized": len(report.quantized),
    "high_precision": reasons,
    "not_a_weight_gemm": len(report.rows) - len(weights),
    "rows": [
      {
        "path": r.path,
        "call": r.call,
        "shapes": [list(shape) for shape in r.shapes],
        "role": r.role,
        "status": r.status,
      }
      for r in report.rows
    ],
  }


def training_verdict(losses: list[float], plain: Optional[list[float]]) -> str:
  if not all(math.isfinite(x) for x in losses):
    return "not finite"
  if losses[-1] < losses[0]:
    return "falls"
  if plain and abs(losses[-1] - plain[-1]) <= NEAR_PLAIN * abs(plain[-1]):
    return "near plain"
  return "neither falls nor ends near plain"


class Findings:
  """One model's results; `attempt` records a step's failure and lets the run go on."""

  def __init__(self, package: str, model: str, show_traceback: bool):
    self.record: dict[str, Any] = {"package": package, "model": model, "failures": []}
    self.show_traceback = show_traceback

  @contextlib.contextmanager
  def attempt(self, step: str):
    try:
      yield
    except Exception as error:  # noqa: BLE001 (a real package may fail anywhere: record it)
      self.record["failures"].append({"step": step, "error": first_line(error)})
      print(f"  FAILED {step}: {first_line(error)}")
      if self.show_traceback:
        traceback.print_exc()


# ---- Linen models (gemma) ----


@dataclasses.dataclass(frozen=True)
class LinenModel:
  name: str
  module: Any  # an unbound Linen module
  logits_of: Callable[[Any], jax.Array]  # the module's output -> logits


def linen_logits(model: LinenModel, module, params, tokens, key):
  out = module.apply({"params": params}, tokens, rngs={jqf.QUANT_RNG: key})
  return model.logits_of(out)


def linen_train(model: LinenModel, module, params, tokens) -> list[float]:
  optimizer = optax.adam(LEARNING_RATE)

  @jax.jit
  def step(params, opt_state, key):
    loss_fn = lambda p: next_token_loss(linen_logits(model, module, p, tokens, key), tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = optimizer.init(params), []
  for i in range(STEPS):
    params, opt_state, loss = step(params, opt_state, jax.random.key(i))
    losses.append(float(loss))
  return losses


def run_linen(package: str, model: LinenModel, tokens, show_traceback: bool = False) -> dict:
  start = time.perf_counter()
  findings = Findings(package, model.name, show_traceback)
  record = findings.record
  params = model.module.init(jax.random.key(0), tokens)["params"]

  def logits(module, params):
    return jax.jit(lambda p: linen_logits(model, module, p, tokens, jax.random.key(0)))(params)

  plain_logits = logits(model.module, params)
  with findings.attempt("bf16 bit-identical"):
    quantized = logits(jqf.quantize_model(model.module, "bf16"), params)
    record["bf16_bit_identical"] = bool(jnp.array_equal(quantized, plain_logits))
  with findings.attempt("train plain"):
    record["train"] = {"plain": {"losses": linen_train(model, model.module, params, tokens)}}
  for recipe in TRAINED_RECIPES:
    qmodule = jqf.quantize_model(model.module, recipe, on_unfit=ON_UNFIT)
    with findings.attempt(f"swap_report {recipe}"):
      report = jqf.swap_report(qmodule, {"params": params}, tokens)
      record.setdefault("swap_report", {})[recipe] = report_summary(report)
    with findings.attempt(f"train {recipe}"):
      losses = linen_train(model, qmodule, params, tokens)
      record.setdefault("train", {})[recipe] = {"losses": losses}
  return finish(record, time.perf_counter() - start)


# ---- NNX models (MaxText, EasyDeL) ----


@dataclasses.dataclass(frozen=True)
class NnxModel:
  name: str
  build: Callable[[Optional[str]], Any]  # recipe for a `quant=` hook (or None) -> a fresh model
  call_args: Callable[[jax.Array], tuple[tuple, dict]]  # tokens -> the model's call arguments
  logits_of: Callable[[Any], jax.Array]
  context: Callable[[Any], Any] = lambda model: contextlib.nullcontext()
  # True: build the model with the package's own quantization hook (`build(recipe)`).
  through_hook: bool = False


def nnx_logits(model: NnxModel, module, tokens):
  args, kwargs = model.call_args(tokens)
  return model.logits_of(module(*args, **kwargs))


def nnx_quantized(model: NnxModel, recipe: Optional[str], params: Any):
  """A fresh model under `recipe`, its parameters set to `params`.

  The parameters are copied in because building with a hook draws more keys from the
  model's Rngs than building without (MaxText bridges each hook with keys of its own), so
  the same seed would not give the same parameters. Through the package's hook, the model
  is then given to `quantize_model` too: that names every layer (the hooks' roles are
  their paths) and quantizes the layers the package gives no hook.
  """
  module = model.build(recipe if model.through_hook else None)
  nnx.update(module, params)
  if recipe is None:
    return module
  return jqf.quantize_model(module, recipe, on_unfit=ON_UNFIT, rngs=nnx.Rngs(quant=0))


def nnx_train(model: NnxModel, module, tokens) -> list[float]:
  optimizer = nnx.Optimizer(module, optax.adam(LEARNING_RATE), wrt=nnx.Param)

  @nnx.jit
  def step(module, optimizer):
    loss_fn = lambda m: next_token_loss(nnx_logits(model, m, tokens), tokens)
    loss, grads = nnx.value_and_grad(loss_fn)(module)
    optimizer.update(module, grads)
    return loss

  with model.context(module):
    return [float(step(module, optimizer)) for _ in range(STEPS)]


def run_nnx(package: str, model: NnxModel, tokens, show_traceback: bool = False) -> dict:
  start = time.perf_counter()
  findings = Findings(package, model.name, show_traceback)
  record = findings.record
  logits = nnx.jit(lambda m: nnx_logits(model, m, tokens))
  params = nnx.state(model.build(None), nnx.Param)  # every run starts from these
  plain = nnx_quantized(model, None, params)
  with model.context(plain):
    plain_logits = logits(plain)
  with findings.attempt("bf16 bit-identical"):
    bf16 = nnx_quantized(model, "bf16", params)
    with model.context(bf16):
      record["bf16_bit_identical"] = bool(jnp.array_equal(logits(bf16), plain_logits))
  with findings.attempt("train plain"):
    record["train"] = {"plain": {"losses": nnx_train(model, plain, tokens)}}
  for recipe in TRAINED_RECIPES:
    with findings.attempt(f"swap_report {recipe}"):
      module = nnx_quantized(model, recipe, params)
      args, kwargs = model.call_args(tokens)
      with model.context(module):
        report = jqf.swap_report(module, *args, **kwargs)
      record.setdefault("swap_report", {})[recipe] = report_summary(report)
    with findings.attempt(f"train {recipe}"):
      losses = nnx_train(model, nnx_quantized(model, recipe, params), tokens)
      record.setdefault("train", {})[recipe] = {"losses": losses}
  return finish(record, time.perf_counter() - start)


def finish(record: dict, seconds: float) -> dict:
  """Each training run's verdict and its last loss's gap to the plain run's."""
  plain = record.get("train", {}).get("plain", {}).get("losses")
  for name, run in record.get("train", {}).items():
    run["verdict"] = training_verdict(run["losses"], None if name == "plain" else plain)
    if plain and name != "plain":
      run["last_loss_gap_to_plain"] = run["losses"][-1] / plain[-1] - 1
  record["seconds"] = round(seconds, 1)
  return record
