"""Model and training sizes by name.

tiny: seconds, for CI. cpu (the default): all eight recipes in under 10 minutes on a
2-core CPU; there, quantized recipes run through jaxquant's exact pure-JAX emulation,
whose compile time (one quantized GEMM site per Dense layer) and per-step cost are several
times bf16's, so the model is small and the run short. gpu: a 58M-parameter model for one
H100, sized so all eight recipes (casts through jaxquant's CUDA kernels, GEMMs through the
dispatch table's GPU routes) compile and train in one run of under 9 minutes. gpu_seeds:
the gpu model for `--seeds N`, validated on the whole validation split with the learning
rate decayed to zero (below, why); a group of recipes a call.

`train_lm.py --set FIELD=VALUE` overrides any TrainConfig field of the chosen preset.

Every GEMM dimension is a multiple of 128 (tiny: of 64), so all block formats (MXFP8's 32,
NVFP4's 16, block FP8's 128) tile the weights and the token dimension exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

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
  # Steps of bf16 training before the sensitivity analysis behind 'suggested_nvfp4'.
  sensitivity_steps: int = 10


@dataclasses.dataclass(frozen=True)
class Preset:
  model: ModelConfig
  train: TrainConfig


PRESETS = {
    "tiny": Preset(
        ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2, d_ff=256),
        TrainConfig(batch_size=8, steps=30, warmup_steps=5, peak_learning_rate=3e-3,
                    eval_every=15, eval_batches=2)),
    # Two layers: the custom recipe's bf16 tail is the last one.
    "cpu": Preset(
        ModelConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=512),
        TrainConfig(batch_size=8, steps=150, warmup_steps=15, peak_learning_rate=3e-3,
                    eval_every=25, eval_batches=8)),
    # Six layers: the custom recipe's bf16 tail (the last layer) is NVIDIA's ~15%; the
    # five before it run under nn.scan, so each recipe compiles one layer's body, not five.
    # 16k tokens a step. 1000 steps, not fewer: at 400, two bf16 runs that differ only by
    # GPU non-determinism or a 1e-3 perturbation of the initial parameters ended 1.5-2% apart
    # (the loss still fell fast), at 1000 0.6-0.7% (H100, docs/example.md), so only then
    # can a gap of 1% be told from chance. Eight recipes' compilations and steps (23-55 ms a
    # step on an H100) fit in ten minutes.
    "gpu": Preset(
        ModelConfig(seq_len=512, d_model=896, n_layers=6, n_heads=14, d_ff=3584, scanned_layers=5),
        TrainConfig(batch_size=32, steps=1000, warmup_steps=100, peak_learning_rate=5e-4,
                    eval_every=100, eval_batches=16)),
}
# The gpu model for several seeds a recipe (train_lm.py --seeds), where what matters is
# how far apart seeds end. Against `gpu`:
# - validation on the whole split (1.2M bytes, ~75 batches), the same for every seed:
#   16 sampled batches (262k bytes) left each final loss a few tenths of a percent of
#   sampling noise on top of training's (two models fit different windows best), and
#   with a seed-dependent sample that noise would enter the seed-to-seed spread whole;
# - the learning rate decays to zero, not to 10%: the last steps' updates (and their
#   gradient noise) then shrink to nothing, so the final parameters depend less on the
#   last batches a seed happened to draw;
# - 3000 steps: on the H100, bf16 from seeds 0, 1, 2 spread 1.14 % (sd / mean) after
#   1000 steps (the loss still falling), 0.33 % with 1000 steps of three times the batch,
#   0.19 %, 0.30 % and 0.54 % in three runs of 3000 steps (docs/example.md): the same seed
#   ended up to 0.8 % apart between runs, so the GPU's own non-determinism now dominates.
#   A seed takes ~77 s on an H100 (23 ms a bf16 step): a 10-minute call trains two
#   recipes from three seeds;
# - evaluations every 500 steps: each costs ~0.6 s (bf16) to ~1.1 s (NVFP4) on an H100.
PRESETS["gpu_seeds"] = Preset(
    PRESETS["gpu"].model,
    dataclasses.replace(PRESETS["gpu"].train, steps=3000, final_learning_rate_fraction=0.0,
                        eval_every=500, eval_batches=None, sensitivity_steps=100))
