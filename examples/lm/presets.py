"""Model and training sizes by name.

tiny: seconds, for CI. cpu (the default): all eight recipes in about 3 minutes on an idle
2-core CPU; there, quantized recipes run through jaxquant's exact pure-JAX emulation,
whose compile time (one quantized GEMM site per Dense layer) and per-step cost are several
times bf16's, so the model is small and the run short. gpu: a 58M-parameter model for one
H100, sized so all eight recipes (casts through jaxquant's CUDA kernels, GEMMs through the
dispatch table's GPU routes) compile and train in one run of under 9 minutes. gpu_seeds:
a smaller model for `--seeds N`, validated on the whole validation split with the learning
rate decayed to zero (below, why). gpu_seeds_long: that model trained twice as long on the
standard library and the sources of the packages the example depends on.

`train_lm.py --set FIELD=VALUE` overrides any TrainConfig field of the chosen preset.

Every GEMM dimension is a multiple of 128 (tiny: of 64), so all block formats (MXFP8's 32,
NVFP4's 16, block FP8's 128) tile the weights and the token dimension exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from lm.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  batch_size: int
  steps: int
  warmup_steps: int
  peak_learning_rate: float
  final_learning_rate_fraction: float = 0.1
  weight_decay: float = 0.1
  grad_clip_norm: float = 1.0
  eval_every: int = 50
  # Validation batches of batch_size windows each, drawn at random from the validation
  # split (the same ones at every evaluation of every recipe); None: the whole split,
  # cut into consecutive windows (no sampling at all).
  eval_batches: Optional[int] = 4
  # The tail evaluations: the last `tail_evals`, `tail_eval_every` steps apart (0: eval_every)
  # and ending at the last step. The mean validation loss over them is a run's second
  # statistic beside the final loss (lm/report.py); 1: the final evaluation alone.
  tail_evals: int = 1
  tail_eval_every: int = 0
  # Installed packages whose sources join the standard library's in the corpus (data.py).
  corpus_packages: tuple[str, ...] = ()
  # Steps of bf16 training before the sensitivity analysis behind 'suggested_nvfp4'.
  sensitivity_steps: int = 10
  # Compile the steps so that a seed trains to the same bits on every run (training.py's
  # DETERMINISTIC_XLA_OPTIONS) and use XLA's attention, not cuDNN's. On the H100 the gpu
  # preset's bf16 step then takes 51.5 ms instead of 23.4; without it, three runs of seed 0
  # ended 400 steps at 1.2377, 1.2300 and 1.2338 nats, with it twice at 1.2421.
  deterministic: bool = False

  def tail_steps(self) -> list[int]:
    """The steps of the tail evaluations, ascending."""
    every = self.tail_eval_every or self.eval_every
    if self.tail_evals < 1 or every < 1 or (self.tail_evals - 1) * every >= self.steps:
      raise ValueError(
        f"tail_evals={self.tail_evals} evaluations {every} steps apart do not fit "
        f"{self.steps} steps"
      )
    return [self.steps - i * every for i in reversed(range(self.tail_evals))]


_FINITE = math.isfinite
# Each numeric TrainConfig field's rule, checked on every value `--set` gives (a preset's
# own values keep them): (holds, the rule in words).
FIELD_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
  "batch_size": (lambda v: v >= 1, "an integer >= 1"),
  "steps": (lambda v: v >= 1, "an integer >= 1"),
  "warmup_steps": (lambda v: v >= 0, "an integer >= 0"),
  "peak_learning_rate": (lambda v: _FINITE(v) and v > 0, "a finite number > 0"),
  "final_learning_rate_fraction": (lambda v: _FINITE(v) and 0 <= v <= 1, "a number in [0, 1]"),
  "weight_decay": (lambda v: _FINITE(v) and v >= 0, "a finite number >= 0"),
  "grad_clip_norm": (lambda v: _FINITE(v) and v > 0, "a finite number > 0"),
  "eval_every": (lambda v: v >= 1, "an integer >= 1"),
  "eval_batches": (lambda v: v is None or v >= 1, "an integer >= 1, or all"),
  "tail_evals": (lambda v: v >= 1, "an integer >= 1"),
  "tail_eval_every": (lambda v: v >= 0, "an integer >= 0 (0: eval_every)"),
  "sensitivity_steps": (lambda v: v >= 0, "an integer >= 0"),
}


def field_error(name: str, value) -> Optional[str]:
  """Why `value` cannot be TrainConfig field `name`'s (FIELD_RULES), or None."""
  if name not in FIELD_RULES:
    return None
  holds, rule = FIELD_RULES[name]
  return None if holds(value) else f"{name} must be {rule}, got {value!r}"


@dataclasses.dataclass(frozen=True)
class Preset:
  model: ModelConfig
  train: TrainConfig
  # Runs of bf16 from further seeds that a one-seed run trains by default (train_lm.py
  # --noise-band): the yardstick its single-seed gaps are read against.
  noise_band_runs: int = 0


PRESETS = {
  "tiny": Preset(
    ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2, d_ff=256),
    TrainConfig(
      batch_size=8, steps=30, warmup_steps=5, peak_learning_rate=3e-3, eval_every=15, eval_batches=2
    ),
  ),
  # Two layers: the custom recipe's bf16 tail is the last one. A one-seed run (the default)
  # also trains bf16 from three more seeds, the noise band its gaps are read against (at
  # this size and length single-run gaps of a few percent are mostly noise); they reuse
  # bf16's compiled steps, and evaluating every 30 steps instead of 25 pays for them.
  "cpu": Preset(
    ModelConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=512),
    TrainConfig(
      batch_size=8,
      steps=150,
      warmup_steps=15,
      peak_learning_rate=3e-3,
      eval_every=30,
      eval_batches=8,
    ),
    noise_band_runs=3,
  ),
  # Six layers: the custom recipe's bf16 tail (the last layer) is NVIDIA's ~15%; the
  # five before it run under nn.scan, so each recipe compiles one layer's body, not five.
  # 16k tokens a step. 1000 steps, not fewer: at 400, two bf16 runs that differ only by
  # GPU non-determinism or a 1e-3 perturbation of the initial parameters ended 1.5-2% apart
  # (the loss still fell fast), at 1000 0.6-0.7% (H100, docs/example.md), so only then
  # can a gap of 1% be told from chance. Eight recipes' compilations and steps (23-55 ms a
  # step on an H100) fit in ten minutes.
  "gpu": Preset(
    ModelConfig(seq_len=512, d_model=896, n_layers=6, n_heads=14, d_ff=3584, scanned_layers=5),
    TrainConfig(
      batch_size=32,
      steps=1000,
      warmup_steps=100,
      peak_learning_rate=5e-4,
      eval_every=100,
      eval_batches=16,
    ),
  ),
}
# For several seeds a recipe (train_lm.py --seeds), where what matters is how far apart
# seeds end: a smaller model than `gpu` (10.8M parameters, the same six layers, five of
# them scanned), and against `gpu`:
# - validation on the whole split (1.2M bytes, ~75 batches), the same for every seed:
#   16 sampled batches (262k bytes) left each final loss a few tenths of a percent of
#   sampling noise on top of training's;
# - the learning rate decays to zero, not to 10%: the last steps' updates (and their
#   gradient noise) shrink to nothing, so the final parameters depend less on the last
#   batches a seed happened to draw;
# - 3000 steps (49M tokens, 5.5 passes over the 9M-byte train split), with the model
#   small enough that its validation loss still falls at the end. On the H100, bf16 from
#   seeds 0, 1, 2 ended at (sd / mean): `gpu`'s 58M-parameter model 0.19 %, 0.30 % and
#   0.54 % in three runs (the same seed up to 0.8 % apart between runs; its loss about
#   0.84 nats); a 19M model (d_model 512) 0.53 % (0.816 nats, seed 2's loss rising again
#   from step 2500); this model 0.19 % and 0.39 % in two runs (0.82-0.83 nats, every
#   seed's loss still falling at the end), 0.73 % with twice the batch and 0.31 % (two
#   seeds) with 6000 steps, where every seed's loss rose from step 3000
#   (docs/example.md). None is reliably under 0.2 %;
# - a peak learning rate of 1e-3: the smaller model's;
# - evaluations every 500 steps, and every 100 over the last 400 (the tail: 2600-3000,
#   where the learning rate is under 5 % of its peak): the mean validation loss over those
#   five is the second statistic gaps are taken on (lm/report.py). Over four runs of three
#   seeds with evaluations 500 steps apart, the evaluations at 2500 and 3000 of one run
#   differed far less than runs did, so that mean cannot be much less noisy than the final
#   loss; the results give both.
# A bf16 step takes 9 ms on an H100, a seed with its evaluations ~30 s.
PRESETS["gpu_seeds"] = Preset(
  ModelConfig(seq_len=512, d_model=384, n_layers=6, n_heads=6, d_ff=1536, scanned_layers=5),
  dataclasses.replace(
    PRESETS["gpu"].train,
    steps=3000,
    peak_learning_rate=1e-3,
    final_learning_rate_fraction=0.0,
    eval_every=500,
    eval_batches=None,
    tail_evals=5,
    tail_eval_every=100,
    sensitivity_steps=100,
  ),
)
# gpu_seeds' model trained twice as long on a corpus four times larger: the standard library
# and the sources of the installed packages the example depends on (on the H100 machine 35 MB
# of train sources, 2.8 passes in 6000 steps, and 3.3 MB of validation). On that corpus bf16
# ended 3000 steps 0.67 % and 1.12 % apart (sd / mean; seeds 0-5 and 6-11), and 6000 steps
# 0.24 % (H100, seeds 0-5) and 0.47 % (H200, seeds 0-7) apart; 9000 and 12000 steps (0.21 %,
# 0.35 %) and the 58M `gpu` model (0.26 % after 4000 and after 6000 steps) ended no closer
# (docs/example.md). 6000 steps is where the spread stops falling. A bf16 step takes 9 ms
# on an H100 and a quantized one 10-15 ms (gpu_seeds'), so a seed of bf16 takes about a
# minute and of NVFP4 about a minute and a half: bf16 and one recipe from three seeds fit a
# ten-minute device call (two FP8 recipes barely, by these estimates).
PRESETS["gpu_seeds_long"] = Preset(
  PRESETS["gpu_seeds"].model,
  dataclasses.replace(
    PRESETS["gpu_seeds"].train,
    steps=6000,
    corpus_packages=("jax", "jaxlib", "flax", "numpy", "optax", "orbax", "ml_dtypes"),
  ),
)
