"""Train a byte-level decoder-only transformer under each low-precision recipe, and compare.

The corpus is this interpreter's standard library source (no download), with the
gpu_seeds_long preset also the sources of the installed packages the example depends on
(jax, flax, numpy, ...). Every recipe starts from the same parameters and sees the same
batches in the same order, so the validation-loss gaps between recipes come from the
number formats alone. With --seeds N each recipe trains from N seeds (each sets the
parameters and the data order, the same for every recipe); the results give the mean and
spread over seeds and each recipe's gap to bf16 with a 95% paired t-interval.

  python examples/train_lm.py                         # all recipes, the cpu preset: ~3 min
  python examples/train_lm.py --preset gpu            # ~58M parameters, for one H100
  python examples/train_lm.py --recipes bf16,mxfp8 --steps 100
  python examples/train_lm.py --noise-floor           # + bf16 again from a perturbed start
  python examples/train_lm.py --preset gpu_seeds --seeds 3 --recipes bf16,mxfp8,hybrid
  python examples/train_lm.py --preset gpu_seeds_long --seeds 3 --recipes bf16,nvfp4
  python examples/train_lm.py --recipes bf16,custom,suggested_nvfp4   # an analysed policy
  python examples/train_lm.py --mesh data=2,fsdp=2,tensor=2   # sharded over 8 devices
  python examples/launch_local.py --processes 2 --cpu-devices-per-process 4 -- \\
      python examples/train_lm.py --mesh fsdp=8   # over 2 processes (jax.distributed)

Outputs (in --out, by default train_lm_runs/<preset>-<start time>, a folder of its own for
every command; an --out holding an earlier run's outputs is refused without --overwrite):
val_loss.png (the validation curves of all recipes, bands over seeds),
results.md (final validation loss, spread, gap to bf16 with its interval, step time) and
curves.json (everything, for replotting); with suggested_nvfp4 also sensitivity.md and
sensitivity.png (the analysis that chose its policy).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import math
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from lm import data, distributed, layout, presets, recipes, report, sharding, suggested, training
from lm.model import ModelConfig, TransformerLM, fused_attention_compiles
from lm.moe import moe_mlp_factory
from lm.progress import ProgressBar

from jaxquant import analysis

# The host waits for the device once every SYNC_EVERY steps (and at each eval), not every
# step: in between it queues the next steps while the device computes.
SYNC_EVERY = 10
# The default --out: a folder of its own for every command, under the working directory
# (not the package), named by the preset and the start time: no run overwrites another's.
DEFAULT_RUNS = pathlib.Path("train_lm_runs")
# Relative size of the noise-floor run's perturbation: far below any format's rounding error.
NOISE_FLOOR_SCALE = 1e-3
# suggested_nvfp4's sensitivity report, next to the other outputs.
SENSITIVITY_TABLE = "sensitivity.md"
SENSITIVITY_PNG = "sensitivity.png"
RECIPE_HELP = (
  "'all' (" + ", ".join(recipes.RECIPE_NAMES) + ") or a comma-separated list of "
  f"those, {recipes.SUGGESTED_RECIPE} and {', '.join(recipes.FAST_ACCUMULATION_RECIPES)} "
  "(those presets with every GEMM accumulating fast). "
  f"'{recipes.CUSTOM_RECIPE}' is a per-role "
  "policy: NVFP4 with the last layers and the head in bf16 (NVIDIA's NVFP4 recipe); "
  f"'{recipes.SUGGESTED_RECIPE}' keeps as many GEMM modules in bf16, chosen by "
  "jaxquant.analysis after a short bf16 training (see --sensitivity-rank)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--recipes", default="all", help=RECIPE_HELP)
  parser.add_argument("--preset", default="cpu", choices=sorted(presets.PRESETS))
  parser.add_argument("--steps", type=int, help="training steps per recipe (default: the preset's)")
  parser.add_argument(
    "--moe", action="store_true", help="replace each MLP with jaxquant's MoE block"
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help=f"output folder (default: {DEFAULT_RUNS}/<preset>-<start time>, one per command)",
  )
  parser.add_argument(
    "--overwrite",
    action="store_true",
    help="replace the outputs of an earlier run in --out (without it, such a folder is refused "
    "before anything runs)",
  )
  parser.add_argument(
    "--seed",
    type=int,
    default=0,
    help="seeds the parameters and the data order (the first seed with --seeds)",
  )
  parser.add_argument(
    "--validation-seed",
    type=int,
    help="with sampled validation batches (eval_batches=N): the seed that "
    "draws them (default: --seed), so that runs of other seeds can share them "
    "(train_seeds.py)",
  )
  parser.add_argument(
    "--seeds",
    type=int,
    default=1,
    help="train each recipe from this many seeds (--seed, --seed + 1, ...); the "
    "results give each recipe's mean and spread over seeds and each gap to "
    "bf16 with its 95%% paired t-interval",
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="override a training field of the preset, e.g. --set "
    "final_learning_rate_fraction=0 --set eval_batches=all (the whole "
    "validation split) --set corpus_packages=jax,flax (comma-separated); "
    "fields: " + ", ".join(f.name for f in dataclasses.fields(presets.TrainConfig)),
  )
  parser.add_argument(
    "--sensitivity-model-runs",
    choices=("none", "module", "role"),
    default="none",
    help=f"{recipes.SUGGESTED_RECIPE}: also measure each module's (or role's) "
    "effect on the loss and gradient (one compilation each) besides its "
    "GEMM SQNRs, which rank it",
  )
  parser.add_argument(
    "--sensitivity-rank",
    choices=analysis.RANK_BY,
    default="gemm_sqnr",
    help=f"{recipes.SUGGESTED_RECIPE}: keep in bf16 the modules of the worst "
    "GEMM SQNR, or of the largest loss change (needs --sensitivity-model-runs "
    "module)",
  )
  parser.add_argument(
    "--noise-floor",
    action="store_true",
    help=f"after the recipes, train bf16 once more ('{report.NOISE_FLOOR}') from "
    f"the initial parameters times 1 + {NOISE_FLOOR_SCALE:g} N(0, 1): its gap to "
    "bf16 is how far one run moves with no quantization at all",
  )
  parser.add_argument(
    "--noise-band",
    type=int,
    metavar="N",
    help=f"with one seed: after the recipes, train bf16 from N further seeds "
    f"('{report.NOISE_BAND}'); their gaps to bf16 give the band a single-seed gap must "
    "leave to mean something (default: the preset's, 3 for cpu; 0 with --seeds > 1)",
  )
  parser.add_argument(
    "--repeat-index",
    type=int,
    default=0,
    help="0: the seed's run; R > 0 marks this run as the R-th repeat of its seed "
    "(train_seeds.py --repeats), reported as run-to-run spread, not as a seed",
  )
  parser.add_argument(
    "--suggested-policy",
    type=pathlib.Path,
    metavar="FILE",
    help=f"{recipes.SUGGESTED_RECIPE}: train the policy in FILE (the "
    f"{suggested.POLICY_FILE} an earlier run wrote) instead of analysing again, so that "
    "runs of other seeds or device calls train the same policy",
  )
  parser.add_argument(
    "--mesh",
    metavar="data=D,fsdp=F,tensor=T",
    help="train sharded over a mesh of all devices (D x F x T of them; an axis "
    "left out is 1): the batch split over data and fsdp, every weight split "
    "over fsdp (FSDP) and its MLP, head and vocabulary dims over tensor",
  )
  parser.add_argument(
    "--quantized-gather",
    action="store_true",
    help="with --mesh: quantize each FSDP-sharded weight shard by shard and "
    "all-gather its codes and scales over fsdp instead of its fp32 values "
    "(quantize_model's weight_gather)",
  )
  distributed.add_flags(parser)
  parser.add_argument(
    "--time-budget-s",
    type=float,
    help="stop training once the run has taken this many seconds; the outputs "
    "mark the recipe that was cut short and those not run",
  )
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = DEFAULT_RUNS / f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
  return args


def with_steps(train: presets.TrainConfig, steps: int | None) -> presets.TrainConfig:
  if steps is None:
    return train
  if steps < 1:
    raise ValueError(f"--steps must be >= 1, got {steps}")
  return dataclasses.replace(
    train, steps=steps, warmup_steps=min(train.warmup_steps, max(1, steps // 10))
  )


def with_overrides(train: presets.TrainConfig, assignments: list[str]) -> presets.TrainConfig:
  """--set FIELD=VALUE, each value parsed as the field's type ('all' / 'none': None)."""
  fields = {f.name: f for f in dataclasses.fields(train)}
  changes = {}
  for assignment in assignments:
    name, _, text = assignment.partition("=")
    if name not in fields or not text:
      raise ValueError(
        f"--set {assignment!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}"
      )
    current = getattr(train, name)
    if text.lower() in ("all", "none"):
      if name != "eval_batches":
        raise ValueError(f"--set {assignment!r}: only eval_batches may be 'all' (the whole split)")
      changes[name] = None
    elif isinstance(current, tuple):  # a comma-separated list of names
      changes[name] = tuple(part for part in text.split(",") if part)
    elif isinstance(current, bool):
      if text.lower() not in ("true", "false"):
        raise ValueError(f"--set {assignment!r}: {name} takes true or false")
      changes[name] = text.lower() == "true"
    else:
      kind = float if isinstance(current, float) else int
      try:
        changes[name] = kind(text)
      except ValueError:
        raise ValueError(f"--set {assignment!r}: {name} takes a {kind.__name__}") from None
    error = presets.field_error(name, changes[name])
    if error:
      raise ValueError(f"--set {assignment!r}: {error}")
  return dataclasses.replace(train, **changes)


def build_models(recipe_names: list[str], config, moe: bool) -> dict[str, recipes.RecipeModel]:
  """Every recipe's model, built before any trains: a bad recipe fails now, not in an hour."""
  models = {}
  for name in recipe_names:
    recipe = recipes.recipe_for(name, config)
    if moe:
      recipe = recipes.for_moe_block(recipe)
    plain_model = TransformerLM(config, moe_mlp_factory(recipe) if moe else None)
    models[name] = recipes.model_for_recipe(plain_model, recipe)
  return models


def mesh_of(args) -> jax.sharding.Mesh | None:
  """--mesh's mesh (None: one device)."""
  if args.mesh is None:
    return None
  return sharding.make_mesh(sharding.parse_mesh(args.mesh))


class RecipeTrainer:
  """One recipe's optimizer and jitted steps, compiled once and reused for every seed."""

  def __init__(
    self,
    name: str,
    model: recipes.RecipeModel,
    train_config: presets.TrainConfig,
    validation_batches: Sequence[jax.Array],
    mesh: jax.sharding.Mesh | None = None,
    quantized_gather: bool = False,
  ):
    self.name, self.train_config = name, train_config
    self.validation_batches = validation_batches  # [batch, seq + 1] each
    self.optimizer = training.make_optimizer(train_config)
    self.shardings = None
    if mesh is not None:
      placement = training.placement_for(model, self.sample_tokens(), mesh)
      self.shardings = training.step_shardings(self.optimizer, placement)
      if quantized_gather:
        model = recipes.with_quantized_gather(model, mesh, placement.params, sharding.FSDP)
    self.model = model
    self.train_step = training.make_train_step(
      model, self.optimizer, self.shardings, train_config.deterministic
    )
    self.eval_step = training.make_eval_step(model, self.shardings, train_config.deterministic)
    self.compile_seconds: float | None = None  # the first seed's first step

  def renamed(self, name: str) -> RecipeTrainer:
    """This trainer (its compiled steps) reporting its runs under another name."""
    trainer = copy.copy(self)
    trainer.name = name
    return trainer

  def sample_tokens(self) -> jax.Array:
    seq_len = self.validation_batches[0].shape[-1] - 1
    return jnp.zeros((self.train_config.batch_size, seq_len), jnp.int32)

  def train(
    self, initial_params, corpus: data.ByteCorpus, seed: int, deadline: float
  ) -> report.RecipeResult:
    """Trains from one seed; stops early (and says so in the result) once
    perf_counter() > deadline."""
    recipe_start = time.perf_counter()
    train_config = self.train_config
    seq_len = self.validation_batches[0].shape[-1] - 1
    tokens_per_step = train_config.batch_size * seq_len
    state = training.init_train_state(
      self.model,
      initial_params,
      jax.random.key(seed),
      self.sample_tokens(),
      self.optimizer,
      self.shardings,
    )

    def validation_loss() -> float:
      return float(np.mean([self.eval_step(state, windows) for windows in self.validation_batches]))

    tail_steps = train_config.tail_steps()
    result = report.RecipeResult(
      self.name,
      planned_steps=train_config.steps,
      eval_steps=[0],
      val_losses=[validation_loss()],
      train_losses=[],
      window_step_seconds=[],
      compile_seconds=0.0,
      seed=seed,
      tail_steps=tail_steps if len(tail_steps) > 1 else [],
    )
    batches = data.train_batches(corpus.train, seed, train_config.batch_size, seq_len)
    if self.shardings is not None:  # every process draws the global batch, places its shards
      batch_sharding = self.shardings.batch
      batches = (sharding.global_array(windows, batch_sharding) for windows in batches)
    progress = ProgressBar(f"{self.name} (seed {seed})", train_config.steps, sys.stdout)
    window_losses, window_start = [], time.perf_counter()
    for step in range(1, train_config.steps + 1):
      state, loss = self.train_step(state, next(batches))
      window_losses.append(loss)  # a device array: the host runs ahead until the window ends
      evaluate = step % train_config.eval_every == 0 or step in tail_steps
      if step == 1 or evaluate or step % SYNC_EVERY == 0:
        result.train_losses.extend(float(loss) for loss in window_losses)  # waits for the window
        seconds = (time.perf_counter() - window_start) / len(window_losses)
        if step == 1:
          if self.compile_seconds is None:
            self.compile_seconds = seconds
          result.compile_seconds = self.compile_seconds
        else:
          result.window_step_seconds.append(seconds)
        progress.update(step, result.train_losses[-1], tokens_per_step / seconds)
        out_of_time = distributed.past(deadline)
        if evaluate or out_of_time:
          result.eval_steps.append(step)
          result.val_losses.append(validation_loss())
        if out_of_time:
          break
        window_losses, window_start = [], time.perf_counter()
    progress.close()
    if not result.window_step_seconds:  # a one-step run: its only step compiled too
      result.window_step_seconds.append(result.compile_seconds)
    result.wall_seconds = time.perf_counter() - recipe_start
    return result


def run_info(
  args,
  model: ModelConfig,
  train_config,
  n_params: int,
  corpus,
  entropy,
  mesh: jax.sharding.Mesh | None,
) -> dict:
  model_config = {k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(model).items()}
  return {
    "preset": args.preset,
    "seed": args.seed,
    "seeds": seeds_of(args),
    "validation_seed": validation_seed_of(args),
    "moe": args.moe,
    "model": model_config,
    "train": dataclasses.asdict(train_config),
    "parameters": n_params,
    "noise_floor_scale": NOISE_FLOOR_SCALE if args.noise_floor else None,
    "noise_band_runs": noise_band_runs_of(args),
    "repeat": args.repeat_index,
    "corpus": {
      "root": str(corpus.root),
      "packages": list(corpus.packages),
      "train_bytes": int(corpus.train.size),
      "validation_bytes": int(corpus.validation.size),
      "train_files": corpus.n_train_files,
      "validation_files": corpus.n_validation_files,
    },
    "unigram_entropy_nats": entropy,
    "unigram_entropy_bits": data.nats_to_bits(entropy),
    "platform": jax.default_backend(),
    "device": str(jax.devices()[0]),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "versions": versions(),
    "command": " ".join(["python", *sys.argv]),
    "mesh": None if mesh is None else dict(mesh.shape),
    "quantized_gather": args.quantized_gather,
  }


def versions() -> dict:
  """Python's and the packages' the results depend on."""
  found = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "flax", "optax", "numpy"):
    try:
      found[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      found[package] = None
  return found


def where(mesh: jax.sharding.Mesh | None) -> str:
  if mesh is None:
    return str(jax.devices()[0])
  processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  return (
    f"mesh {sharding.describe(mesh)} of {mesh.size} x {jax.devices()[0].device_kind}{processes}"
  )


def seeds_of(args) -> list[int]:
  if args.seeds < 1:
    raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
  return [args.seed + i for i in range(args.seeds)]


def noise_band_runs_of(args) -> int:
  if args.noise_band is not None:
    if args.noise_band and args.seeds > 1:
      raise ValueError("--noise-band is for one seed: with --seeds the intervals are the yardstick")
    return args.noise_band
  return presets.PRESETS[args.preset].noise_band_runs if args.seeds == 1 else 0


def validation_seed_of(args) -> int:
  return args.seed if args.validation_seed is None else args.validation_seed


def validation_set(
  corpus: data.ByteCorpus, train_config: presets.TrainConfig, seq_len: int, seed: int
) -> np.ndarray:
  """The one validation set of the run, the same for every recipe and seed."""
  if train_config.eval_batches is None:
    return data.whole_split_batches(corpus.validation, train_config.batch_size, seq_len)
  return data.fixed_validation_batches(
    corpus.validation, seed, train_config.eval_batches, train_config.batch_size, seq_len
  )


def suggested_run(args, model_config, train_config, shared_params: dict, corpus, out) -> tuple:
  """(model, params of each seed, text for results.md, the GEMM modules kept in bf16) of
  'suggested_nvfp4': analysed on the first seed (writing the analysis and the policy to
  out; process 0 only), or read from --suggested-policy."""
  writes = distributed.is_primary()
  if writes:
    out.mkdir(parents=True, exist_ok=True)
  if args.suggested_policy is not None:
    policy = suggested.read_policy(args.suggested_policy, model_config)
    suggestion = suggested.from_policy(model_config, policy)
    text = (
      f"{recipes.SUGGESTED_RECIPE}: NVFP4 with the head and these {len(suggestion.kept)} GEMM "
      f"modules in bf16, as {args.suggested_policy} says (chosen by {policy['rank_by']} "
      f"after {policy['sensitivity_steps']} bf16 steps of seed {policy['seed']}): "
      f"{', '.join(suggestion.kept)}. It trains with {suggestion.config.scanned_layers} "
      "scanned layers.\n"
    )
    if writes:
      suggested.write_policy(out / suggested.POLICY_FILE, policy)
    print(text)
  else:
    first_seed = min(shared_params)
    model_runs = None if args.sensitivity_model_runs == "none" else args.sensitivity_model_runs
    start = time.perf_counter()
    suggestion = suggested.suggest(
      model_config,
      shared_params[first_seed],
      train_config,
      corpus.train,
      first_seed,
      model_runs,
      args.sensitivity_rank,
    )
    table = suggestion.report.table(args.sensitivity_rank)  # in the order that chose
    if writes:
      (out / SENSITIVITY_TABLE).write_text(table)
      analysis.plot_sensitivity(
        suggestion.report, out / SENSITIVITY_PNG, rank_by=args.sensitivity_rank
      )
      suggested.write_policy(
        out / suggested.POLICY_FILE,
        suggested.policy_of(
          suggestion, first_seed, args.sensitivity_rank, train_config.sensitivity_steps
        ),
      )
    text = (
      f"{recipes.SUGGESTED_RECIPE}: NVFP4 with the head and these {len(suggestion.kept)} GEMM "
      f"modules in bf16, ranked most sensitive to NVFP4 ({args.sensitivity_rank}) by "
      f"jaxquant.analysis after "
      f"{train_config.sensitivity_steps} bf16 steps of seed {first_seed} "
      f"({time.perf_counter() - start:.0f} s; {SENSITIVITY_TABLE}, {SENSITIVITY_PNG}): "
      f"{', '.join(suggestion.kept)}. It trains with {suggestion.config.scanned_layers} "
      "scanned layers.\n"
    )
    print(text + table)
  model = recipes.model_for_recipe(TransformerLM(suggestion.config), suggestion.recipe)
  relaid = {
    seed: layout.relayout(p, model_config, suggestion.config.scanned_layers)
    for seed, p in shared_params.items()
  }
  return model, relaid, text, list(suggestion.kept)


# Every file a run writes into --out.
OUTPUT_FILES = (
  report.CURVES_JSON,
  report.RESULTS_TABLE,
  report.CURVES_PNG,
  suggested.POLICY_FILE,
  SENSITIVITY_TABLE,
  SENSITIVITY_PNG,
)


def check_arguments(args: argparse.Namespace) -> presets.TrainConfig:
  """Every flag, `--set` value, policy file and process option, checked before anything
  runs or is written (an error names the flag, the value and the rule); the training
  config they give."""
  distributed.check_flags(args)
  train_config = with_overrides(
    with_steps(presets.PRESETS[args.preset].train, args.steps), args.set
  )
  train_config.tail_steps()  # fits the run, or says why not
  seeds_of(args)
  if args.noise_band is not None and args.noise_band < 0:
    raise ValueError(f"--noise-band {args.noise_band}: a number of runs, >= 0")
  noise_band_runs_of(args)
  budget = args.time_budget_s
  if budget is not None and not (math.isfinite(budget) and budget > 0):
    raise ValueError(f"--time-budget-s {budget}: a finite number of seconds > 0")
  if args.repeat_index < 0:
    raise ValueError(f"--repeat-index {args.repeat_index}: 0 (the seed's run) or a repeat > 0")
  recipe_names = recipes.parse_recipe_names(args.recipes)
  if args.moe and recipes.SUGGESTED_RECIPE in recipe_names:
    raise ValueError(f"--moe: {recipes.SUGGESTED_RECIPE} is not available with the MoE block")
  if args.sensitivity_rank == "loss_change" and args.sensitivity_model_runs != "module":
    raise ValueError(
      "--sensitivity-rank loss_change ranks by each module's model-level effect: "
      "it needs --sensitivity-model-runs module"
    )
  if args.suggested_policy is not None:  # read whether or not its recipe runs
    suggested.read_policy(args.suggested_policy, presets.PRESETS[args.preset].model)
  if args.mesh is not None:
    sharding.parse_mesh(args.mesh)
  elif args.quantized_gather:
    raise ValueError(
      "--quantized-gather gathers FSDP-sharded weights: it needs --mesh with fsdp > 1"
    )
  earlier = [name for name in OUTPUT_FILES if (args.out / name).exists()]
  if earlier and not args.overwrite:
    raise ValueError(
      f"--out {args.out}: holds an earlier run's {', '.join(earlier)}; give another --out, or "
      "--overwrite to replace them"
    )
  return train_config


def main(argv: list[str] | None = None) -> list[report.RecipeResult]:
  start = time.perf_counter()
  args = parse_args(argv)
  train_config = check_arguments(args)
  distributed.initialize(args)
  with distributed.primary_output():
    return train_recipes(args, train_config, start)


def train_recipes(
  args: argparse.Namespace, train_config: presets.TrainConfig, start: float
) -> list[report.RecipeResult]:
  """Every run of the command line (`check_arguments` has checked it and given
  train_config); in a job of several processes each runs all of it (the same steps on the
  same data), process 0 alone writing the outputs."""
  model_config = presets.PRESETS[args.preset].model
  if train_config.deterministic:
    training.check_deterministic_options()
  noise_band_runs = noise_band_runs_of(args)
  # Deterministic steps keep XLA's attention: cuDNN's deterministic backward fails at run
  # time at the gpu preset's shapes (JAX 0.11.2, H100).
  if (
    jax.default_backend() == "gpu"
    and not train_config.deterministic
    and fused_attention_compiles(model_config)
  ):
    model_config = dataclasses.replace(model_config, attention_implementation="cudnn")
  recipe_names = recipes.parse_recipe_names(args.recipes)
  if (
    recipes.SUGGESTED_RECIPE in recipe_names
    and args.suggested_policy is None
    and jax.process_count() > 1
  ):
    raise ValueError(
      f"{recipes.SUGGESTED_RECIPE} in {jax.process_count()} processes: give the policy "
      "with --suggested-policy (processes analysing apart could choose apart)"
    )
  mesh = mesh_of(args)
  if args.quantized_gather and (mesh is None or mesh.shape[sharding.FSDP] == 1):
    raise ValueError(
      "--quantized-gather gathers FSDP-sharded weights: it needs --mesh with fsdp > 1"
    )
  if mesh is not None:
    sharding.check_batch(train_config.batch_size, mesh)
  models = build_models(
    [n for n in recipe_names if n != recipes.SUGGESTED_RECIPE], model_config, args.moe
  )
  # Every recipe starts from these: the bf16 (plain) model's parameters.
  plain_model = build_models([recipes.PLAIN_RECIPE], model_config, args.moe)[recipes.PLAIN_RECIPE]

  corpus = data.load_corpus(train_config.corpus_packages)
  entropy = data.unigram_entropy_nats(corpus.validation)
  packages = f" and {', '.join(corpus.packages)}" if corpus.packages else ""
  print(
    f"corpus: {corpus.root}{packages}: {corpus.train.size:,} train bytes "
    f"({corpus.n_train_files} files), {corpus.validation.size:,} validation bytes "
    f"({corpus.n_validation_files} files)"
  )
  print(
    f"unigram byte entropy of the validation split: {entropy:.4f} nats "
    f"({data.nats_to_bits(entropy):.4f} bits) per byte"
  )

  seq_len = model_config.seq_len
  seeds = seeds_of(args)
  sample_tokens = jnp.zeros((train_config.batch_size, seq_len), jnp.int32)
  # Every recipe starts from these: the bf16 (plain) model's parameters, one set a seed.
  shared_params = {
    seed: training.init_variables(plain_model.module, jax.random.key(seed), sample_tokens)[
      training.PARAMS
    ]
    for seed in seeds
  }
  n_params = sum(p.size for p in jax.tree.leaves(shared_params[seeds[0]]))
  print(
    f"model: {n_params:,} parameters, preset {args.preset!r}, {train_config.steps} steps of "
    f"{train_config.batch_size}x{seq_len} tokens, seeds {seeds}, on {where(mesh)}, "
    f"attention: {model_config.attention_implementation or 'xla'}"
  )
  if jax.default_backend() == "cpu":
    print(report.CPU_EMULATION_NOTE)
  print(f"outputs to {args.out}")
  validation_windows = validation_set(corpus, train_config, seq_len, validation_seed_of(args))
  if mesh is None:
    validation_batches = jnp.asarray(validation_windows)
  else:  # placed once, shared by every recipe
    batch_sharding = sharding.batch_sharding(mesh)
    validation_batches = [sharding.global_array(w, batch_sharding) for w in validation_windows]
  print(
    f"validation: {len(validation_batches)} batches of {train_config.batch_size} windows "
    f"({len(validation_batches) * train_config.batch_size * seq_len:,} predicted bytes), "
    "the same for every recipe and seed"
  )

  info = {
    **run_info(args, model_config, train_config, n_params, corpus, entropy, mesh),
    "notes": "",
  }
  deadline = start + (args.time_budget_s or math.inf)
  # (name, model or None: built when its turn comes, starting parameters of each seed)
  runs = [(name, models.get(name), shared_params) for name in recipe_names]
  if args.noise_floor:
    runs.append(
      (
        report.NOISE_FLOOR,
        plain_model,
        {
          seed: training.perturbed(p, jax.random.key(seed + 1), NOISE_FLOOR_SCALE)
          for seed, p in shared_params.items()
        },
      )
    )
  if noise_band_runs:
    # bf16 from the seeds after the run's own: params of seed s + i, data order of s + i.
    band_seeds = [seeds[-1] + i for i in range(1, noise_band_runs + 1)]
    band_params = {
      seed: training.init_variables(plain_model.module, jax.random.key(seed), sample_tokens)[
        training.PARAMS
      ]
      for seed in band_seeds
    }
    runs.append((report.NOISE_BAND, plain_model, band_params))
  run_names = [name for name, _, _ in runs]
  results: list[report.RecipeResult] = []
  trainers: dict[str, RecipeTrainer] = {}
  for index, (name, model, params) in enumerate(runs):
    if results and distributed.past(deadline):
      break
    if name == recipes.SUGGESTED_RECIPE:
      model, params, notes, kept = suggested_run(
        args, model_config, train_config, shared_params, corpus, args.out
      )
      # Recorded, so that runs merged later (lm/merge.py) are checked to share the policy.
      info = {**info, "notes": notes, "suggested_policy": kept}
    if name == report.NOISE_BAND and recipes.PLAIN_RECIPE in trainers:
      trainer = trainers[recipes.PLAIN_RECIPE].renamed(name)  # bf16's steps, compiled already
    else:
      trainer = RecipeTrainer(
        name, model, train_config, validation_batches, mesh, args.quantized_gather
      )
    trainers[name] = trainer
    for seed in sorted(params):
      if seed != min(params) and distributed.past(deadline):
        break
      result = trainer.train(params[seed], corpus, seed, deadline)
      results.append(dataclasses.replace(result, repeat=args.repeat_index))
      # After every run, so a run cut short (--time-budget-s, or killed) still leaves what it
      # finished, and names the rest as not run.
      if distributed.is_primary():
        report.write_outputs(args.out, results, {**info, "not_run": run_names[index + 1 :]})
  ran = {r.recipe for r in results}
  not_run = [name for name in run_names if name not in ran]
  if distributed.is_primary():
    report.write_outputs(args.out, results, {**info, "not_run": not_run})
  print()
  print(report.results_table(results, not_run, entropy), end="")
  for summary in report.summarize(results):
    if summary.loss is not None:
      spread = "" if summary.loss.std is None else f" ± {summary.loss.std:.4f} (sd over seeds)"
      print(
        f"{summary.recipe}: final validation loss {summary.loss.mean:.4f}{spread} nats per "
        f"byte; unigram byte entropy {entropy:.4f}"
      )
  print(
    f"outputs in {args.out}: {report.CURVES_PNG}, {report.RESULTS_TABLE}, {report.CURVES_JSON}"
    + (f", {SENSITIVITY_TABLE}, {SENSITIVITY_PNG}" if info["notes"] else "")
  )
  print(f"total time {time.perf_counter() - start:.0f} s")
  return results


if __name__ == "__main__":
  main()
