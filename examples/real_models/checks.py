"""The checks each real model goes through: its swap report, bf16 against the plain model
bit for bit, and a few training steps per recipe against the plain model's; under
fp8_delayed, whether the delayed-scaling state advances over those steps.

Linen models (gemma) are quantized by wrapping (`quantize_model` returns a new module
over the same parameters); NNX models (MaxText, EasyDeL) in place, so each NNX run builds
a fresh model and copies the same parameters into it. A failing step is recorded with
its error's first line (`Findings.attempt`) and the other steps still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxquant.flax as jqf

TRAINED_RECIPES = ("fp8_current", "fp8_delayed", "mxfp8", "nvfp4")
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
# Flax's collection of variables that a train step overwrites with their gradient.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


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


def role_states(tree: Any) -> list[jqf.RoleState]:
  """Every delayed-scaling state (`jqf.RoleState`) in a pytree of collections or NNX state."""
  return [
    leaf for leaf in jax.tree.leaves(tree, is_leaf=jqf.is_role_state) if jqf.is_role_state(leaf)
  ]


def scales_of(states: list[jqf.RoleState]) -> dict[str, Any]:
  """Each state's scales by its role and tensor type (a grouped or scanned state holds one
  scale per expert or layer)."""
  return {f"{s.role.name} ({s.role.tensor_type})": jax.device_get(s.scaling.scale) for s in states}


def scale_progress(snapshots: list[list[jqf.RoleState]]) -> dict:
  """How the delayed-scaling states moved over the steps, from the states after each step.

  A fresh state's scale is 1 and its amax history empty; a state that advances records
  amaxes and moves its scales. NNX models make a routed GEMM's state at its first call,
  so a state missing before a step counts as fresh there.
  """
  final = snapshots[-1]
  scales = [scales_of(states) for states in snapshots]
  per_step, previous = [], {}
  for now in scales:
    changed = sum(
      int(jnp.sum(value != previous.get(name, jnp.ones_like(value)))) for name, value in now.items()
    )
    per_step.append(changed)
    previous = now
  total = sum(int(s.scaling.scale.size) for s in final)
  off_initial = sum(int(jnp.sum(s.scaling.scale != 1)) for s in final)
  recorded = sum(int(jnp.sum(jnp.any(s.scaling.amax_history != 0, axis=-1))) for s in final)
  finite = all(bool(jnp.all(jnp.isfinite(s.scaling.scale))) for s in final)
  advanced = bool(final) and off_initial == total and recorded == total and finite
  return {
    "states": len(final),
    "scales": total,
    "scales_changed_per_step": per_step,
    "scales_off_initial_at_end": off_initial,
    "scales_with_amax_records_at_end": recorded,
    "all_finite": finite,
    "not_advanced": not_advanced(final),
    "verdict": "scales advance" if advanced else "scales do not all advance",
  }


def not_advanced(states: list[jqf.RoleState]) -> list[str]:
  """The states whose scale is still its initial 1, without amax records, or not finite:
  "<role name> (<tensor type>)", with the indices of the experts or layers that did not
  advance for a grouped or scanned state."""
  stuck = []
  for s in states:
    moved = (s.scaling.scale != 1) & jnp.any(s.scaling.amax_history != 0, axis=-1)
    moved = jax.device_get(moved & jnp.isfinite(s.scaling.scale))
    if moved.all():
      continue
    where = "" if moved.ndim == 0 else f" at {np.argwhere(~moved).tolist()}"
    stuck.append(f"{s.role.name} ({s.role.tensor_type}){where}")
  return stuck


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
  # tokens -> the module's call arguments (most models take the tokens alone)
  call_args: Callable[[jax.Array], tuple[tuple, dict]] = lambda tokens: ((tokens,), {})


def linen_logits(model: LinenModel, module, params, tokens, key):
  args, kwargs = model.call_args(tokens)
  out = module.apply({"params": params}, *args, rngs={jqf.QUANT_RNG: key}, **kwargs)
  return model.logits_of(out)


def linen_train(model: LinenModel, module, params, tokens, collections=None):
  """STEPS Adam steps: the losses, and the delayed-scaling states after each step.

  `collections` (the `"quant_state"` collection of a delayed-scaling recipe, from the
  quantized module's `init`) are threaded as README's Linen train step does: mutable in the
  forward, differentiated, and advanced once a step by `update_quant_state`.
  """
  optimizer = optax.adam(LEARNING_RATE)
  collections = dict(collections or {})
  mutable = list(collections)

  args, kwargs = model.call_args(tokens)

  def loss_fn(params, collections, key):
    variables = {"params": params, **collections}
    kwargs_rngs = dict(kwargs, rngs={jqf.QUANT_RNG: key})
    if mutable:
      out, updated = module.apply(variables, *args, mutable=mutable, **kwargs_rngs)
    else:
      out, updated = module.apply(variables, *args, **kwargs_rngs), {}
    return next_token_loss(model.logits_of(out), tokens), updated

  @jax.jit
  def step(params, opt_state, collections, key):
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, updated), (grads, state_grads) = grad_fn(params, collections, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    collections = jqf.update_quant_state(updated, state_grads)
    return optax.apply_updates(params, updates), opt_state, collections, loss

  opt_state, losses, states = optimizer.init(params), [], []
  for i in range(STEPS):
    params, opt_state, collections, loss = step(params, opt_state, collections, jax.random.key(i))
    losses.append(float(loss))
    states.append(role_states(collections))
  return losses, states


def train_record(losses: list[float], states: list[list[jqf.RoleState]]) -> dict:
  """A training run's losses, and how its delayed-scaling states moved where it has any."""
  record: dict[str, Any] = {"losses": losses}
  if states[-1]:
    record["delayed_scaling"] = scale_progress(states)
  return record


def run_linen(package: str, model: LinenModel, tokens, show_traceback: bool = False) -> dict:
  start = time.perf_counter()
  findings = Findings(package, model.name, show_traceback)
  record = findings.record
  args, kwargs = model.call_args(tokens)
  params = model.module.init(jax.random.key(0), *args, **kwargs)["params"]

  def logits(module, params):
    return jax.jit(lambda p: linen_logits(model, module, p, tokens, jax.random.key(0)))(params)

  plain_logits = logits(model.module, params)
  with findings.attempt("bf16 bit-identical"):
    quantized = logits(jqf.quantize_model(model.module, "bf16"), params)
    record["bf16_bit_identical"] = bool(jnp.array_equal(quantized, plain_logits))
  with findings.attempt("train plain"):
    losses, _ = linen_train(model, model.module, params, tokens)
    record["train"] = {"plain": {"losses": losses}}
  for recipe in TRAINED_RECIPES:
    qmodule = jqf.quantize_model(model.module, recipe, on_unfit=ON_UNFIT)
    collections: dict = {}
    with findings.attempt(f"init {recipe}"):
      # The quantized module's own collections (delayed scaling's "quant_state"), made by
      # its init where its shapes say it has any; its params are the plain model's.
      init = functools.partial(qmodule.init, **kwargs)
      if set(jax.eval_shape(init, jax.random.key(0), *args)) - {"params"}:
        variables = jax.jit(init)(jax.random.key(0), *args)
        collections = {k: v for k, v in variables.items() if k != "params"}
    with findings.attempt(f"swap_report {recipe}"):
      report = jqf.swap_report(qmodule, {"params": params, **collections}, *args, **kwargs)
      record.setdefault("swap_report", {})[recipe] = report_summary(report)
    with findings.attempt(f"train {recipe}"):
      losses, states = linen_train(model, qmodule, params, tokens, collections)
      record.setdefault("train", {})[recipe] = train_record(losses, states)
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


def overwrite_with_gradient() -> type:
  """The NNX Variable type of Flax's `_overwrite_with_gradient` collection, where MaxText's
  `quant=` hooks keep their delayed-scaling state (its gradient is its next value)."""
  return nnx.variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT, allow_register=True)


def nnx_train(model: NnxModel, module, tokens):
  """STEPS Adam steps: the losses, and the delayed-scaling states after each step.

  The step is README's NNX train step, with MaxText's handling of
  `_overwrite_with_gradient` besides: the params, the `QuantState`s and those variables
  differentiated; the params updated by Adam, the `QuantState`s advanced by
  `update_quant_state`, the `_overwrite_with_gradient` variables set to their gradient.
  A model without delayed scaling has neither kind of state, and the step is a plain one.
  """
  optimizer = nnx.Optimizer(module, optax.adam(LEARNING_RATE), wrt=nnx.Param)
  owg = overwrite_with_gradient()

  @nnx.jit
  def step(module, optimizer):
    loss_fn = lambda m: next_token_loss(nnx_logits(model, m, tokens), tokens)
    diff = nnx.DiffState(0, (nnx.Param, jqf.QuantState, owg))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(module)
    optimizer.update(module, nnx.filter_state(grads, nnx.Param))
    jqf.update_quant_state(module, grads)
    nnx.update(module, nnx.filter_state(grads, owg))
    return loss

  def states():
    return role_states(nnx.state(module, (jqf.QuantState, owg)))

  losses, snapshots = [], []
  with model.context(module):
    if states():
      # A model with delayed-scaling state (its swapped layers', its hooks') gets one call
      # before the steps: the GEMMs its own code contracts make theirs at their first
      # call, and a state made inside a step has no gradient there (docs/flax.md, "State").
      nnx.jit(lambda m: nnx_logits(model, m, tokens))(module)
    for _ in range(STEPS):
      losses.append(float(step(module, optimizer)))
      snapshots.append(states())
  return losses, snapshots


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
    losses, _ = nnx_train(model, plain, tokens)
    record["train"] = {"plain": {"losses": losses}}
  for recipe in TRAINED_RECIPES:
    with findings.attempt(f"swap_report {recipe}"):
      module = nnx_quantized(model, recipe, params)
      args, kwargs = model.call_args(tokens)
      with model.context(module):
        report = jqf.swap_report(module, *args, **kwargs)
      record.setdefault("swap_report", {})[recipe] = report_summary(report)
    with findings.attempt(f"train {recipe}"):
      losses, states = nnx_train(model, nnx_quantized(model, recipe, params), tokens)
      record.setdefault("train", {})[recipe] = train_record(losses, states)
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
