"""Model and training sizes by name.

tiny: seconds, for CI. cpu: all recipes in under 10 minutes on a 2-core CPU (quantized
recipes run through jaxquant's pure-JAX emulation there, a few times slower than bf16).
gpu: a 57M-parameter model for one H100 (bf16: 154 ms a step, 1000 steps in ~3 minutes;
the step count still has to be fitted to the quantized recipes' GPU speed).

Every GEMM dimension is a multiple of 128 (tiny: of 64), so all block formats (MXFP8's 32,
NVFP4's 16, block FP8's 128) tile the weights and the token dimension exactly.
"""

from __future__ import annotations

import dataclasses

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
  eval_batches: int = 4


@dataclasses.dataclass(frozen=True)
class Preset:
  model: ModelConfig
  train: TrainConfig


PRESETS = {
    "tiny": Preset(
        ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2, d_ff=256),
        TrainConfig(batch_size=8, steps=40, warmup_steps=5, peak_learning_rate=3e-3,
                    eval_every=20, eval_batches=2)),
    # bf16 takes ~100 ms of CPU time a step here; quantized recipes a few times that.
    "cpu": Preset(
        ModelConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=512),
        TrainConfig(batch_size=16, steps=200, warmup_steps=20, peak_learning_rate=3e-3,
                    eval_every=25, eval_batches=4)),
    "gpu": Preset(
        ModelConfig(seq_len=512, d_model=768, n_layers=8, n_heads=12, d_ff=3072),
        TrainConfig(batch_size=64, steps=1000, warmup_steps=100, peak_learning_rate=1e-3,
                    eval_every=100, eval_batches=16)),
}
