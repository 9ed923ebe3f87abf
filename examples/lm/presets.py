"""Model and training sizes by name.

tiny: seconds, for CI. cpu (the default): all eight recipes in under 10 minutes on a
2-core CPU; there, quantized recipes run through jaxquant's exact pure-JAX emulation,
whose compile time (one quantized GEMM site per Dense layer) and per-step cost are several
times bf16's, so the model is small and the run short. gpu: a 58M-parameter model for one
H100, sized so all eight recipes (casts through jaxquant's CUDA kernels, GEMMs through the
dispatch table's GPU routes) compile and train in one run of under 9 minutes.

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
    # (the loss still fell fast), at 1000 0.6-0.7% (H100, notes/example.md), so only then
    # can a gap of 1% be told from chance. Eight recipes' compilations and steps (23-55 ms a
    # step on an H100) fit in ten minutes.
    "gpu": Preset(
        ModelConfig(seq_len=512, d_model=896, n_layers=6, n_heads=14, d_ff=3584, scanned_layers=5),
        TrainConfig(batch_size=32, steps=1000, warmup_steps=100, peak_learning_rate=5e-4,
                    eval_every=100, eval_batches=16)),
}
