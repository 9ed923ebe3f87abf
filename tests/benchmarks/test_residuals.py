"""benchmarks/residuals.py on the CPU: what the step's backward pass keeps per variant, at a
tiny shape, and that its totals add up."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import residuals  # noqa: E402
from step_model import SHAPES, DecoderStack  # noqa: E402

BATCH, SEQ, LAYERS = 2, 128, 1
TOKENS = BATCH * SEQ
S = SHAPES["tiny"]
KV = S.n_kv_heads * S.head_dim
# Every projection's kernel: q and o d x d, k and v d x kv, gate, up and down d x ffn.
KERNEL_PARAMS = LAYERS * (2 * S.d_model**2 + 2 * S.d_model * KV + 3 * S.d_model * S.d_ff)
PROJECTIONS = 7 * LAYERS


@pytest.fixture(scope="module")
def analyses():
  return {
    name: residuals.analyze(name, "tiny", LAYERS, BATCH, SEQ, "flash")
    for name in ("bf16", "fp8_current")
  }


def _bytes(analysis, keep):
  return sum(r.bytes for r in analysis.residuals if keep(r))


def _norm_output_bf16(r):  # the RMSNorm's output in the compute dtype: q/k/v's, gate/up's input
  return r.dtype == "bf16" and "normalization.py" in r.source and "(_normalize)" in r.source


def _swiglu_product_bf16(r):  # silu(gate) * up: down's input
  return r.dtype == "bf16" and r.source.startswith("mul from") and "._mlp)" in r.source


def test_fp8_current_keeps_gemm_inputs_only_as_their_e4m3_codes(analyses):
  bf16, fp8 = analyses["bf16"], analyses["fp8_current"]
  # bf16 keeps the norms' outputs and the SwiGLU product for its GEMMs' wgrad ...
  assert _bytes(bf16, _norm_output_bf16) == 2 * LAYERS * TOKENS * S.d_model * 2
  assert _bytes(bf16, _swiglu_product_bf16) == LAYERS * TOKENS * S.d_ff * 2
  # ... fp8_current no high-precision copy of them: each projection keeps its input's
  # columnwise codes (one byte a value, transposed) and one fp32 scale.
  assert _bytes(fp8, _norm_output_bf16) == 0
  assert _bytes(fp8, _swiglu_product_bf16) == 0
  inputs = [r for r in fp8.residuals if r.source.startswith("jaxquant.input_")]
  codes = [r for r in inputs if r.shape]
  assert {r.dtype for r in codes} == {"f8_e4m3fn"}
  assert sorted(r.shape for r in codes) == sorted(
    [(S.d_model, TOKENS)] * 6 * LAYERS + [(S.d_ff, TOKENS)] * LAYERS
  )
  assert [r.dtype for r in inputs if not r.shape] == ["f32"] * PROJECTIONS


def test_weights_are_kept_as_bf16_casts_or_e4m3_codes(analyses):
  bf16_casts = _bytes(
    analyses["bf16"],
    lambda r: r.dtype == "bf16" and r.source.startswith("convert_element_type from flax/linen"),
  )
  assert bf16_casts == 2 * KERNEL_PARAMS + _bytes(analyses["bf16"], _norm_output_bf16)
  weights = [
    r for r in analyses["fp8_current"].residuals if r.source.startswith("jaxquant.weight_")
  ]
  assert sum(r.bytes for r in weights) == KERNEL_PARAMS + 4 * PROJECTIONS


def test_totals_add_up(analyses):
  for analysis in analyses.values():
    groups = analysis.groups()
    assert sum(count for count, _ in groups.values()) == len(analysis.residuals)
    assert sum(size for _, size in groups.values()) == analysis.total() + analysis.total(
      argument=True
    )
    sizes = [size for _, size in groups.values()]
    assert sizes == sorted(sizes, reverse=True)
    assert analysis.state_bytes == 4 * 4 * (KERNEL_PARAMS + 2 * LAYERS * S.d_model) + 4
  table = residuals.summary(list(analyses.values()))
  ratio = analyses["fp8_current"].total() / analyses["bf16"].total()
  assert f"| fp8_current | {analyses['fp8_current'].total() / 2**30:.3f} | {ratio:.3f} |" in table


def test_the_flash_stand_in_computes_xla_attention_and_keeps_what_cudnn_keeps():
  stock = DecoderStack(S, LAYERS, attention="xla")
  stand_in = residuals.stock_model("tiny", LAYERS, "flash")
  x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, S.d_model), jnp.bfloat16)
  params = jax.jit(stock.init)(jax.random.key(1), x)
  loss = lambda model: lambda p: jnp.mean(jnp.square(model.apply(p, x).astype(jnp.float32)))
  want, want_grads = jax.jit(jax.value_and_grad(loss(stock)))(params)
  got, got_grads = jax.jit(jax.value_and_grad(loss(stand_in)))(params)
  assert got == want
  jax.tree.map(np.testing.assert_array_equal, got_grads, want_grads)
  kept = {
    r.source: (r.dtype, r.shape)
    for r in residuals.saved_residuals(loss(stand_in), params)
    if r.source.startswith("flash_attention_")
  }
  assert kept == {
    "flash_attention_q": ("bf16", (BATCH, SEQ, S.n_heads, S.head_dim)),
    "flash_attention_k": ("bf16", (BATCH, SEQ, S.n_kv_heads, S.head_dim)),
    "flash_attention_v": ("bf16", (BATCH, SEQ, S.n_kv_heads, S.head_dim)),
    "flash_attention_output": ("bf16", (BATCH, SEQ, S.n_heads, S.head_dim)),
    "flash_attention_softmax_stats": ("f32", (BATCH, S.n_heads, SEQ)),
  }


def test_the_script_prints_a_table_per_variant_and_the_totals(capsys):
  residuals.main(
    ["--shape", "tiny", "--layers", "1", "--batch", "2", "--seq", "128", "--variants", "mxfp8"]
  )
  out = capsys.readouterr().out
  assert "### mxfp8" in out and "### bf16" not in out
  assert "| jaxquant.input_scales | f8_e8m0fnu[" in out  # the block scales
  assert "| mxfp8 |" in out
