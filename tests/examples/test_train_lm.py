"""The language-model example: end to end on the tiny preset, and its pieces."""

import collections
import dataclasses
import fcntl
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import flax.linen as nn  # noqa: E402
import train_lm  # noqa: E402  (needs examples/ on the path)
from lm import data, layout, moe, presets, recipes, report, stats, suggested, training  # noqa: E402
from lm.model import AUX_LOSSES, TransformerLM  # noqa: E402

from jaxquant import kernels as jq_kernels  # noqa: E402
from jaxquant import recipes as jq_recipes  # noqa: E402
from jaxquant.flax import is_role_state, weight_roles  # noqa: E402
from jaxquant.quantizers import NVFP4Quantizer  # noqa: E402

TINY = presets.PRESETS["tiny"]


# CI time: each compiled recipe costs 10-30 s of CPU (the MoE block and quantized recipes
# the most), so the script runs end to end once, in bf16; the quantized paths are checked
# by a two-step run on one layer and by tracing (no compilation).


def _train_tiny(out: pathlib.Path) -> str:
  """Runs the script as a user runs it (tiny preset, bf16, two seeds) into `out`; its
  standard output."""
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
  }
  completed = subprocess.run(
    [
      sys.executable,
      str(EXAMPLES / "train_lm.py"),
      "--preset",
      "tiny",
      "--recipes",
      "bf16",
      "--noise-floor",
      "--seeds",
      "2",
      "--seed",
      "3",
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    env=env,
  )
  assert completed.returncode == 0, completed.stdout + completed.stderr
  return completed.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[pathlib.Path, str]:
  """The tiny run's folder and standard output, made once a session. Under xdist every
  worker that takes one of its tests would make its own (half a minute of CI's CPU each),
  so the workers share one in the session's common temporary folder, the first to get
  there making it while the others wait on a lock."""
  if "PYTEST_XDIST_WORKER" not in os.environ:
    out = tmp_path_factory.mktemp("train_lm")
    return out, _train_tiny(out)
  shared = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's own
  out, stdout = shared / "train_lm", shared / "train_lm.stdout"
  with open(shared / "train_lm.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not stdout.exists():
      out.mkdir(exist_ok=True)
      stdout.write_text(_train_tiny(out))
  return out, stdout.read_text()


def test_writes_all_outputs(tiny_run):
  out, stdout = tiny_run
  for name in ("val_loss.png", "results.md", "curves.json"):
    assert (out / name).stat().st_size > 0, name
  assert "| bf16 |" in (out / "results.md").read_text()
  on_cpu = json.loads((out / "curves.json").read_text())["run"]["platform"] == "cpu"
  assert (report.CPU_EMULATION_NOTE in (out / "results.md").read_text()) == on_cpu
  assert (report.CPU_EMULATION_NOTE in stdout) == on_cpu


def test_noise_floor_starts_elsewhere_and_reports_a_gap(tiny_run):
  out, _ = tiny_run
  curves = json.loads((out / "curves.json").read_text())["recipes"]
  for seed in ("3", "4"):
    bf16, perturbed = curves["bf16"]["seeds"][seed], curves[report.NOISE_FLOOR]["seeds"][seed]
    assert perturbed["completed"] and perturbed["val_losses"][0] != bf16["val_losses"][0]
  table = (out / "results.md").read_text()
  assert f"| {report.NOISE_FLOOR} |" in table and "noise floor" in table


def test_perturbed_scales_each_element_independently():
  params = {"w": jnp.ones((64, 64)), "b": jnp.full((64,), 2.0)}
  moved = training.perturbed(params, jax.random.key(0), 1e-3)
  ratio = np.asarray(moved["w"]) - 1.0
  assert 0.5e-3 < ratio.std() < 2e-3 and np.unique(ratio).size > 1000
  assert np.all(np.abs(np.asarray(moved["b"]) / 2.0 - 1.0) < 1e-2)


def test_loss_decreases(tiny_run):
  out, stdout = tiny_run
  curves = json.loads((out / "curves.json").read_text())
  assert curves["run"]["not_run"] == [] and curves["run"]["seeds"] == [3, 4]
  for bf16 in curves["recipes"]["bf16"]["seeds"].values():
    assert bf16["completed"] and bf16["val_losses"][-1] < bf16["val_losses"][0] - 0.5
  assert "unigram byte entropy" in stdout


def test_seeds_start_apart_and_are_summarized(tiny_run):
  out, _ = tiny_run
  recipes_json = json.loads((out / "curves.json").read_text())["recipes"]
  bf16 = recipes_json["bf16"]
  assert bf16["seeds"]["3"]["val_losses"][0] != bf16["seeds"]["4"]["val_losses"][0]
  finals = [bf16["seeds"][s]["final_val_loss"] for s in ("3", "4")]
  assert bf16["final_val_loss"]["n"] == 2
  assert bf16["final_val_loss"]["mean"] == pytest.approx(np.mean(finals))
  assert bf16["final_val_loss"]["std"] == pytest.approx(np.std(finals, ddof=1))
  # The noise floor's gap: per seed against bf16 of the same seed, with its interval.
  perturbed = recipes_json[report.NOISE_FLOOR]
  gaps = [
    perturbed["seeds"][s]["final_val_loss"] / bf16["seeds"][s]["final_val_loss"] - 1
    for s in ("3", "4")
  ]
  low, high = perturbed["gap_to_bf16"]["interval"]
  half_width = 12.706 * np.std(gaps, ddof=1) / np.sqrt(2)  # t(0.975, 1)
  assert (low, high) == pytest.approx(
    (np.mean(gaps) - half_width, np.mean(gaps) + half_width), rel=1e-3
  )
  table = (out / "results.md").read_text()
  assert "| bf16 | 2 of 2 |" in table and "paired t-interval" in table
  assert "| seed 3 | seed 4 |" in table


# Under nn.scan: the scanned path's state stacking and RNG splitting get checked too.
ONE_LAYER = dataclasses.replace(TINY.model, n_layers=1, scanned_layers=1)


def _train(recipe_name: str, steps: int, deterministic: bool = False):
  """((collections, rng) before, the train state after `steps` steps) of a one-layer tiny
  model from seed 0."""
  plain = TransformerLM(ONE_LAYER)
  model = recipes.model_for_recipe(plain, recipes.recipe_for(recipe_name, ONE_LAYER))
  tokens = jnp.zeros((TINY.train.batch_size, ONE_LAYER.seq_len), jnp.int32)
  params = training.init_variables(plain, jax.random.key(0), tokens)[training.PARAMS]
  optimizer = training.make_optimizer(TINY.train)
  state = training.init_train_state(model, params, jax.random.key(0), tokens, optimizer)
  # Copies: the step donates its input state.
  before = (jax.tree.map(np.asarray, state.collections), np.asarray(jax.random.key_data(state.rng)))
  step = training.make_train_step(model, optimizer, deterministic=deterministic)
  batches = data.train_batches(
    data.load_corpus().train, 0, TINY.train.batch_size, ONE_LAYER.seq_len
  )
  for _ in range(steps):
    state, _ = step(state, next(batches))
  return before, state


def test_delayed_scales_follow_the_amaxes_of_all_three_roles():
  (old_state, old_rng), state = _train("fp8_delayed", steps=2)
  new_state, new_rng = state.collections, np.asarray(jax.random.key_data(state.rng))
  old = old_state["quant_state"]["decoder"]["layers"]["layer"]["mlp"]["wi"]
  new = new_state["quant_state"]["decoder"]["layers"]["layer"]["mlp"]["wi"]
  for tensor_type in ("input", "weight", "grad_output"):  # grad_output: from the backward pass
    assert old[tensor_type].scaling.scale.shape == (1,)  # one per scanned layer
    assert float(old[tensor_type].scaling.scale[0]) == 1.0
    assert float(new[tensor_type].scaling.scale[0]) != 1.0, tensor_type
  assert not np.array_equal(old_rng, new_rng)  # the 'quant' stream gets a fresh key per step


def test_moe_block_is_wired_in_with_the_recipe_and_its_aux_loss():
  """Traced only (jax.eval_shape): the grouped projections' roles and the sown loss."""
  model = train_lm.build_models(["fp8_current"], TINY.model, moe=True)["fp8_current"].module
  tokens = jnp.zeros((2, TINY.model.seq_len), jnp.int32)
  rngs = {"params": jax.random.key(0), "quant": jax.random.key(1)}
  variables = jax.eval_shape(model.init, rngs, tokens)
  roles = weight_roles(variables["params"])
  grouped = {path: q for path, (role, q) in roles.items() if role.module_type == "grouped_linear"}
  assert len(grouped) == 3 * TINY.model.n_layers  # gate, up, down of every block
  assert all(type(q).__name__ == "Float8Quantizer" for q in grouped.values())
  _, sown = jax.eval_shape(
    lambda v: model.apply(v, tokens, rngs={"quant": jax.random.key(2)}, mutable=[AUX_LOSSES]),
    {"params": nn.unbox(variables["params"])},
  )
  assert len(jax.tree.leaves(sown[AUX_LOSSES])) == TINY.model.n_layers


def test_moe_block_under_fp8_delayed_holds_a_state_per_expert():
  model = train_lm.build_models(["fp8_delayed"], TINY.model, moe=True)["fp8_delayed"].module
  tokens = jnp.zeros((2, TINY.model.seq_len), jnp.int32)
  variables = jax.eval_shape(model.init, {"params": jax.random.key(0)}, tokens)
  states = [
    s
    for s in jax.tree.leaves(variables["quant_state"], is_leaf=is_role_state)
    if s.role.module_type == "grouped_linear"
  ]
  assert len(states) == 3 * 3 * TINY.model.n_layers  # gate, up, down; their three roles
  assert {s.scaling.scale.shape for s in states} == {(moe.NUM_EXPERTS,)}


def test_validation_split_is_deterministic_and_disjoint():
  root = data.load_corpus().root
  files = [p.relative_to(root).as_posix() for p in data.stdlib_source_files(root)]
  assert files == sorted(files)
  assert not any("site-packages" in f or "/test/" in f"/{f}" for f in files)
  validation = [f for f in files if data.is_validation_file(f, 10)]
  assert 0 < len(validation) < len(files) / 5
  assert validation == [f for f in files if data.is_validation_file(f, 10)]


def test_package_sources_join_the_corpus_split_by_their_package_paths():
  stdlib = data.load_corpus()
  corpus = data.load_corpus(("optax",))
  files = data.package_source_files("optax")
  assert files and all(relative.startswith("optax/") for relative, _ in files)
  assert not any("/tests/" in f"/{relative}" for relative, _ in files)
  in_validation = [data.is_validation_file(relative, 10) for relative, _ in files]
  sizes = [path.stat().st_size for _, path in files]
  # The standard library's bytes first, then the package's, each file in its own split.
  assert corpus.n_validation_files == stdlib.n_validation_files + sum(in_validation)
  assert corpus.n_train_files == stdlib.n_train_files + len(files) - sum(in_validation)
  assert corpus.validation.size == stdlib.validation.size + sum(
    size for size, v in zip(sizes, in_validation, strict=False) if v
  )
  np.testing.assert_array_equal(corpus.train[: stdlib.train.size], stdlib.train)
  assert len(corpus.packages) == 1 and corpus.packages[0].startswith("optax ")
  with pytest.raises(RuntimeError, match="no_such_package_xyz"):
    data.load_corpus(("no_such_package_xyz",))


def test_train_windows_repeat_for_the_same_seed():
  tokens = (np.arange(1000) % 256).astype(np.uint8)
  first = next(data.train_batches(tokens, seed=3, batch_size=4, seq_len=8))
  again = next(data.train_batches(tokens, seed=3, batch_size=4, seq_len=8))
  assert (first == again).all() and first.shape == (4, 9)


Role = collections.namedtuple("Role", "module_type tensor_type name")


def test_custom_policy_keeps_the_last_layers_and_head_in_bf16():
  config = dataclasses.replace(TINY.model, n_layers=8, scanned_layers=6)
  recipe = recipes.nvidia_nvfp4_policy(config)
  for quantized in ("decoder/layer_6/mlp/wi", "decoder/layers/layer/mlp/wi"):
    assert isinstance(recipe.quantizer(Role("linear", "weight", quantized)), NVFP4Quantizer)
  assert recipe.quantizer(Role("linear", "input", "decoder/layer_7/attention/qkv")) is None
  assert recipe.quantizer(Role("linear", "weight", "head")) is None
  with pytest.raises(ValueError, match="scanned_layers=8"):
    recipes.nvidia_nvfp4_policy(dataclasses.replace(config, scanned_layers=8))


@pytest.mark.parametrize("name", recipes.PRESET_RECIPES)
def test_presets_quantize_the_layers_and_keep_the_head_in_bf16(name):
  recipe = recipes.recipe_for(name, TINY.model)
  for tensor_type in ("input", "weight", "grad_output"):
    for layer in ("decoder/layer_1/mlp/wo", "decoder/layers/layer/mlp/wo"):
      assert recipe.quantizer(Role("linear", tensor_type, layer)) is not None
    assert recipe.quantizer(Role("linear", tensor_type, "head")) is None


def test_moe_recipe_keeps_the_router_high_precision_and_the_experts_delayed():
  recipe = recipes.for_moe_block(recipes.recipe_for("fp8_delayed", TINY.model))
  assert recipe.quantizer(Role("linear", "input", "decoder/layer_0/mlp/moe/router")) is None
  expert = recipe.quantizer(Role("grouped_linear", "grad_output", "decoder/layer_0/mlp/moe/up"))
  assert expert == jq_recipes.fp8_delayed_factory(Role("grouped_linear", "grad_output", ""))


@pytest.mark.parametrize("name", recipes.PRESET_RECIPES)
def test_example_recipes_keep_the_presets_settings(name):
  """The bf16 head and the MoE block change which GEMMs a preset quantizes, not how: the
  backward mode, the GEMMs accumulating fast and the tiny GEMMs' treatment stay the
  preset's (docs/example.md)."""
  preset = jq_recipes.get(name)
  settings = lambda r: (r.name, r.backward, r.fast_accumulation, r.tiny_gemms_in_high_precision)
  dense = recipes.recipe_for(name, TINY.model)
  assert settings(dense) == settings(recipes.for_moe_block(dense)) == settings(preset)


@pytest.mark.parametrize("name", sorted(recipes.FAST_ACCUMULATION_RECIPES))
def test_fast_accumulation_recipes_are_their_preset_with_every_gemm_fast(name):
  preset = jq_recipes.get(recipes.FAST_ACCUMULATION_RECIPES[name])
  fast = recipes.recipe_for(name, TINY.model)
  assert fast.name == name and fast.fast_accumulation == frozenset(jq_recipes.GEMMS)
  assert preset.fast_accumulation != fast.fast_accumulation
  assert (fast.backward, fast.tiny_gemms_in_high_precision) == (
    preset.backward,
    preset.tiny_gemms_in_high_precision,
  )
  role = Role("linear", "grad_output", "decoder/layer_0/mlp/wi")
  assert fast.quantizer(role) == preset.quantizer(role)
  head = Role("linear", "input", "head")
  assert fast.quantizer(head) is None


def test_recipe_names():
  assert recipes.parse_recipe_names("all") == list(recipes.RECIPE_NAMES)
  assert recipes.parse_recipe_names("bf16,fp8_delayed_fast") == ["bf16", "fp8_delayed_fast"]
  with pytest.raises(ValueError, match="unknown recipe"):
    recipes.parse_recipe_names("fp9")


def _finished(recipe: str, seed: int, final_loss: float, steps: int = 10) -> report.RecipeResult:
  return report.RecipeResult(
    recipe,
    planned_steps=steps,
    eval_steps=[0, steps],
    val_losses=[5.0, final_loss],
    train_losses=[],
    window_step_seconds=[0.01],
    compile_seconds=1.0,
    seed=seed,
  )


def test_suggested_policy_is_compared_with_custom_seed_by_seed(tmp_path):
  """results.md and curves.json give suggested_nvfp4's gap to custom, taken per seed (a seed
  that one of them did not finish is left out) with its paired t-interval."""
  finals = {
    "bf16": [0.80, 0.82, 0.81],
    "custom": [0.81, 0.83, 0.80],
    "suggested_nvfp4": [0.82, 0.82, 0.85],
  }
  results = [
    _finished(recipe, seed, loss)
    for recipe, losses in finals.items()
    for seed, loss in enumerate(losses)
  ]
  results.append(dataclasses.replace(_finished("suggested_nvfp4", 3, 0.5), eval_steps=[0, 5]))
  results.append(_finished("custom", 3, 0.9))
  gaps = [s / c - 1 for s, c in zip(finals["suggested_nvfp4"], finals["custom"], strict=False)]
  got = report.paired_gap(results, "suggested_nvfp4", "custom")
  assert got.n == 3 and got.mean == pytest.approx(np.mean(gaps))
  half_width = 4.303 * np.std(gaps, ddof=1) / np.sqrt(3)  # t(0.975, 2)
  assert got.interval == pytest.approx(
    (np.mean(gaps) - half_width, np.mean(gaps) + half_width), rel=1e-3
  )
  table = report.results_table(results, [], 3.0)
  low, high = got.interval
  assert (
    f"suggested_nvfp4 against custom (the same number of modules in bf16, chosen by the "
    f"sensitivity analysis instead of by layer), per seed then averaged: {got.mean:+.2%} "
    f"[{low:+.2%}, {high:+.2%}] (95% paired t-interval)."
  ) in table
  report.write_curves_json(tmp_path / "curves.json", results, {})
  saved = json.loads((tmp_path / "curves.json").read_text())["suggested_nvfp4_vs_custom"]
  assert saved["n"] == 3 and saved["mean"] == pytest.approx(got.mean)
  assert report.paired_gap(results[:3], "suggested_nvfp4", "custom") is None
  assert "against custom" not in report.results_table(results[:6], [], 3.0)


def test_student_t_quantiles_match_the_tables():
  # Two-sided 95% critical values of Student's t (any statistics table).
  for dof, expected in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)):
    assert stats.student_t_quantile(0.95, dof) == pytest.approx(expected, abs=1e-3)


def test_summary_of_one_value_has_no_spread():
  summary = stats.summarize([0.5])
  assert (summary.n, summary.mean, summary.std, summary.interval) == (1, 0.5, None, None)


def test_whole_split_batches_tile_the_split():
  tokens = (np.arange(1000) % 251).astype(np.uint8)
  batches = data.whole_split_batches(tokens, batch_size=4, seq_len=10)
  windows = batches.reshape(-1, 11)
  assert batches.shape == (24, 4, 11)  # 99 windows of 10 targets, 3 short of a 25th batch
  np.testing.assert_array_equal(windows[:, 1:].reshape(-1), tokens[1:961])  # each target once
  np.testing.assert_array_equal(windows[1:, 0], windows[:-1, -1])
  with pytest.raises(ValueError, match="no batch"):
    data.whole_split_batches(tokens[:30], batch_size=4, seq_len=10)


KERNELS_ON_GPU = pytest.mark.skipif(
  jax.default_backend() != "gpu" or not jq_kernels.available(),
  reason="needs a GPU and jaxquant's CUDA library",
)


# bf16 holds the step's own atomics (the embedding's scatter-add gradient, attention's
# backward); fp8_current adds the FP8 GEMMs and the amax kernels, nvfp4 stochastic rounding
# keyed by the step's RNG. Each compiles twice, so compiling the quantized recipes with the
# exact pure-JAX reference is left to the GPU, where the kernels run.
@pytest.mark.parametrize(
  "recipe_name",
  [
    "bf16",
    pytest.param("fp8_current", marks=[pytest.mark.gpu, KERNELS_ON_GPU]),
    pytest.param("nvfp4", marks=[pytest.mark.gpu, KERNELS_ON_GPU]),
  ],
)
def test_deterministic_steps_train_a_seed_to_the_same_bits(recipe_name):
  # XLA's attention, as train_lm.py takes with deterministic steps (presets.py says why).
  # Each training compiles its own step (autotuning included).
  finals = []
  for _ in range(2):
    jax.clear_caches()
    finals.append(jax.tree.map(np.asarray, _train(recipe_name, 20, deterministic=True)[1].params))
  first, second = finals
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(second), strict=False
  ):
    np.testing.assert_array_equal(
      a.view(np.uint32), b.view(np.uint32), err_msg=jax.tree_util.keystr(path)
    )


def test_set_overrides_training_fields():
  train = train_lm.with_overrides(
    TINY.train,
    [
      "final_learning_rate_fraction=0",
      "eval_batches=all",
      "eval_every=5",
      "deterministic=true",
      "corpus_packages=optax,numpy",
    ],
  )
  assert (
    train.final_learning_rate_fraction,
    train.eval_batches,
    train.eval_every,
    train.deterministic,
    train.corpus_packages,
  ) == (0.0, None, 5, True, ("optax", "numpy"))
  for bad in ("lr=1", "steps=1.5", "steps=all", "deterministic=1"):
    with pytest.raises(ValueError, match="--set"):
      train_lm.with_overrides(TINY.train, [bad])


def test_validation_seed_draws_the_sampled_validation_batches():
  corpus = data.load_corpus()
  batches = lambda *argv: train_lm.validation_set(
    corpus,
    TINY.train,
    TINY.model.seq_len,
    train_lm.validation_seed_of(train_lm.parse_args(["--preset", "tiny", *argv])),
  )
  shared = batches("--seed", "6", "--validation-seed", "5")
  np.testing.assert_array_equal(shared, batches("--seed", "5"))
  assert not np.array_equal(shared, batches("--seed", "6"))


def test_relayout_moves_the_parameters_between_scan_layouts():
  config = dataclasses.replace(TINY.model, n_layers=3, scanned_layers=2)
  tokens = jnp.zeros((2, config.seq_len), jnp.int32)
  params = training.init_variables(TransformerLM(config), jax.random.key(0), tokens)["params"]
  unrolled = layout.relayout(params, config, 0)
  assert set(unrolled["decoder"]) == {"layer_0", "layer_1", "layer_2", "final_norm"}
  np.testing.assert_array_equal(
    unrolled["decoder"]["layer_1"]["mlp"]["wi"]["kernel"],
    params["decoder"]["layers"]["layer"]["mlp"]["wi"]["kernel"][1],
  )
  back = layout.relayout(unrolled, dataclasses.replace(config, scanned_layers=0), 2)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  one_scanned = layout.relayout(params, config, 1)
  expected = nn.unbox(
    jax.eval_shape(
      TransformerLM(dataclasses.replace(config, scanned_layers=1)).init, jax.random.key(0), tokens
    )["params"]
  )
  assert jax.tree.map(jnp.shape, one_scanned) == jax.tree.map(jnp.shape, expected)
  np.testing.assert_array_equal(
    one_scanned["decoder"]["layer_1"]["attention"]["qkv"]["kernel"],
    params["decoder"]["layers"]["layer"]["attention"]["qkv"]["kernel"][1],
  )


def test_suggested_policy_keeps_as_many_modules_as_custom():
  """suggested.kept_by_custom on a report of the unrolled tiny model's module names."""
  from jaxquant.analysis import ModuleSensitivity, RoleSensitivity, SensitivityReport
  from jaxquant.roles import gemm_roles

  config = dataclasses.replace(TINY.model, scanned_layers=0)
  names = [
    f"decoder/layer_{i}/{m}"
    for i in range(config.n_layers)
    for m in ("attention/qkv", "attention/out", "mlp/wi", "mlp/wo")
  ]
  modules = tuple(
    ModuleSensitivity(
      "linear",
      name,
      {"fprop": 20.0, "dgrad": 20.0, "wgrad": 20.0},
      tuple(
        RoleSensitivity(role, NVFP4Quantizer(), {}, None, None)
        for role in gemm_roles("linear", name).values()
      ),
      None,
    )
    for name in names
  )
  report_ = SensitivityReport("nvfp4", 1.0, 1.0, modules)
  assert suggested.kept_by_custom(report_, config) == 4  # the last of two layers: 4 GEMMs
