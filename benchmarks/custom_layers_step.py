"""Train step of a model whose GEMMs are its own layers, against the same model from stock
Flax layers, both swapped in under one recipe (default fp8_current).

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/custom_layers_step.py \
        [--layers 2] [--batch 1 --seq 4096] [--recipe fp8_current] [--quick] [--out FILE]

The model: `--layers` decoder layers at Llama-3-8B's layer shape (d_model 4096, SwiGLU
14336, 32 query heads of 128), no embedding or head, params fp32, compute bf16, random
bf16 activations [batch, seq, d_model], loss the mean square of the output, AdamW. Its
GEMMs are, in the `custom` variant, an `Einsum(nn.Module)` that creates its weight and
calls `jnp.einsum` (attention `NDH` / `NHD` weights, a `[2, F, H]` gating weight with
'...F,NFH->...NH'), which the swap-in reaches by routing; in the `stock` variant, the
same equations in `nn.Einsum` layers, which it swaps as before. Attention itself is
`jax.nn.dot_product_attention` in both.

Both steps are jitted in one process, the report of the custom model is checked (every
GEMM quantized, none missed), and the steps are timed in interleaved turns
(timing.interleaved_seconds). Records, merged into
benchmarks/results/<gpu>/custom_layers_step.json: `step_ms` of each variant and
`ratio_custom_vs_stock` (median custom over median stock; 1.0 means routing costs
nothing), plus the lowest and highest per-round ratio. `--quick`: a tiny shape, a smoke
run on any backend (no results file unless --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from records import ResultFile, results_path
from timing import Call, interleaved_seconds

import jaxquant.flax as jqf
from jaxquant import kernels, recipes


@dataclasses.dataclass(frozen=True)
class Shape:
  d_model: int = 4096
  ffn: int = 14336
  heads: int = 32
  head_dim: int = 128


QUICK = Shape(d_model=128, ffn=256, heads=2, head_dim=64)


class Einsum(nn.Module):
  """The model's own GEMM layer (gemma style)."""

  shape: tuple
  dtype: jnp.dtype = jnp.bfloat16

  @nn.compact
  def __call__(self, equation, x):
    w = self.param("w", nn.initializers.lecun_normal(), self.shape)
    return jnp.einsum(equation, x, w.astype(self.dtype))


class Layer(nn.Module):
  shape: Shape
  stock: bool

  def _einsum(self, weight_shape, equation, name, x):
    if self.stock:
      return nn.Einsum(weight_shape, equation, use_bias=False, dtype=jnp.bfloat16, name=name)(x)
    return Einsum(weight_shape, name=name)(equation, x)

  @nn.compact
  def __call__(self, x):
    s = self.shape
    h = nn.RMSNorm(dtype=jnp.bfloat16, name="attn_norm")(x)
    q, k, v = (
      self._einsum((s.heads, s.d_model, s.head_dim), "BTD,NDH->BTNH", n, h)
      for n in ("q_einsum", "k_einsum", "v_einsum")
    )
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self._einsum(
      (s.heads, s.head_dim, s.d_model), "BTNH,NHD->BTD", "attn_vec_einsum", attended
    )
    h = nn.RMSNorm(dtype=jnp.bfloat16, name="mlp_norm")(x)
    gate = self._einsum((2, s.d_model, s.ffn), "...F,NFH->...NH", "gating_einsum", h)
    hidden = jax.nn.silu(gate[..., 0, :]) * gate[..., 1, :]
    return x + self._einsum((s.ffn, s.d_model), "...H,HF->...F", "linear", hidden)


class Stack(nn.Module):
  shape: Shape
  layers: int
  stock: bool

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = Layer(self.shape, self.stock, name=f"layer_{i}")(x)
    return x


def train_step(model, tx):
  """AdamW on the params; the other collections (delayed scaling's "quant_state", where
  the recipe keeps one) advanced by `update_quant_state`, as README's Linen step does."""

  def loss_fn(params, collections, x):
    y, updated = model.apply({"params": params, **collections}, x, mutable=list(collections))
    return jnp.mean(y.astype(jnp.float32) ** 2), updated

  @jax.jit
  def step(params, opt_state, collections, x):
    (loss, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    updated = jqf.update_quant_state(updated, state_grads)
    return optax.apply_updates(params, updates), opt_state, updated, loss

  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--recipe", default="fp8_current", choices=sorted(recipes.PRESETS))
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument(
    "--quick", action="store_true", help="a tiny shape (a smoke run: no results file unless --out)"
  )
  parser.add_argument(
    "--out",
    default=None,
    help="results file to merge into (default benchmarks/results/<gpu>/custom_layers_step.json)",
  )
  args = parser.parse_args()
  shape = QUICK if args.quick else Shape()
  seq = 128 if args.quick else args.seq
  recipe = recipes.get(args.recipe)
  device = jax.devices()[0].device_kind
  print(
    f"{device}, JAX {jax.__version__}, kernels: "
    f"{'yes' if kernels.available() else kernels.unavailable_reason()}"
  )
  results = ResultFile(
    results_path(args.out, "custom_layers_step", device, smoke=args.quick),
    benchmark="custom_layers_step",
    device=device,
    jax_version=jax.__version__,
  )
  x = jax.random.normal(jax.random.key(0), (args.batch, seq, shape.d_model), jnp.bfloat16)
  tx = optax.adamw(1e-4)
  calls = {}
  for variant in ("stock", "custom"):
    model = jqf.quantize_model(Stack(shape, args.layers, stock=variant == "stock"), recipe)
    variables = jax.jit(model.init)(jax.random.key(1), x[:, :128])
    params = variables["params"]
    collections = {name: c for name, c in variables.items() if name != "params"}
    if variant == "custom":
      report = jqf.swap_report(model, variables, x)
      print(report)
      assert len(report.quantized) == 6 * args.layers, "a GEMM of the custom model was missed"
    calls[variant] = Call(train_step(model, tx), (params, tx.init(params), collections, x))
  samples = interleaved_seconds(calls, rounds=args.rounds)
  record_shape = {
    **dataclasses.asdict(shape),
    "layers": args.layers,
    "batch": args.batch,
    "seq": seq,
    "recipe": args.recipe,
  }
  for variant, times in samples.items():
    results.add(f"{variant}_layers_step", record_shape, "step_ms", statistics.median(times) * 1e3)
  per_round = [c / s for c, s in zip(samples["custom"], samples["stock"], strict=False)]
  ratio = statistics.median(samples["custom"]) / statistics.median(samples["stock"])
  results.add("custom_layers_step", record_shape, "ratio_custom_vs_stock", ratio)
  results.add(
    "custom_layers_step", record_shape, "ratio_custom_vs_stock_lowest_round", min(per_round)
  )
  results.add(
    "custom_layers_step", record_shape, "ratio_custom_vs_stock_highest_round", max(per_round)
  )
  for record in results.records:
    print(record["op"], record["metric"], record["value"])
  print(f"merged into {results.path}" if results.path else "--quick: no results file written")


if __name__ == "__main__":
  main()
