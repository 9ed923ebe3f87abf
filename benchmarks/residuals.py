"""What each step-benchmark variant's backward pass keeps, from shapes alone (CPU is enough).

    python benchmarks/residuals.py [--shape 8b] [--layers 2] [--batch 4 --seq 4096] \
        [--variants bf16,fp8_current,fp8_delayed,mxfp8] [--attention flash|xla|cudnn]

For one shape of step_model.py's decoder stack and each variant of step_variants.py, the
loss that step.py's train step differentiates (`step.loss_function`: w.r.t. the params
and the model's other collections; the input x is not differentiated) is traced, not run,
on abstract inputs (`jax.eval_shape`, `jax.ShapeDtypeStruct`), so an 8B shape costs no
memory. Its residuals, the arrays the forward pass leaves for the backward pass, are read
with `jax.ad_checkpoint.print_saved_residuals` and grouped by source: the checkpoint name
where one was given (jaxquant's layers name each GEMM operand's residual by role and kind,
`jaxquant.input_codes`, `jaxquant.weight_scales`, ...), else the primitive that made it and its
source line, or the argument it is; then by dtype and shape, with the bytes summed (types
narrower than a byte at their bit width). A table per variant, each group beside the
same group's bytes under bf16, then the totals against bf16's, and the step's training
state (params, their gradients and the AdamW state: `step.state_bytes`), the part of
`peak_gib` that `activation_gib` in step.py leaves out.

Residuals that are arguments (x, the fp32 params) are listed but counted apart: they are
in memory for the whole step anyway.

Attention (`--attention`): cuDNN's flash attention, what the GPU benchmark runs, cannot be
traced without cuDNN, so by default (`flash`) each layer's attention is a stand-in that
keeps what cuDNN's keeps (q, k, v, the output and fp32 softmax statistics [batch, heads,
seq], each tagged `flash_attention_*`) and computes with XLA's attention; `cudnn` traces
the benchmark's own model (a GPU with cuDNN only); `xla` is XLA's attention, which keeps
its [batch, heads, seq, seq] probabilities.

What this counts is what AD saves in the traced program, before XLA compiles it: XLA may
still fuse a residual into its producer or consumer, recompute it, or keep buffers that
are no residual (the gradients, the new params and optimizer state, temporaries of a GEMM
or a cast), so the sum is not XLA's peak; it is what the backward pass needs kept, in the
form each recipe chose to keep it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import math
import pathlib
import re
import sys

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import optax
import step
import step_variants
from step_model import SHAPES, DecoderStack

DEFAULT_VARIANTS = ("bf16", "fp8_current", "fp8_delayed", "mxfp8")
# Checkpoint names of the flash-attention stand-in's residuals.
FLASH_NAMES = ("q", "k", "v", "output", "softmax_stats")


def _attention_xla(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _softmax_statistics(q, k):
  """Each query's log-sum-exp of its causal scores, fp32 [batch, heads, seq]: the
  statistics cuDNN's flash attention keeps for its backward pass."""
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
  scores = jnp.einsum(
    "btkgh,bskh->bkgts", grouped, k, preferred_element_type=jnp.float32
  ) / math.sqrt(head_dim)
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  statistics = jax.nn.logsumexp(jnp.where(causal, scores, -jnp.inf), axis=-1)
  return statistics.reshape(batch, heads, seq)


@jax.custom_vjp
def flash_attention(q, k, v):
  """Causal grouped-query attention computed by XLA, keeping what cuDNN's flash attention
  keeps for the backward pass (which recomputes through XLA's attention)."""
  return _attention_xla(q, k, v)


def _flash_forward(q, k, v):
  out = _attention_xla(q, k, v)
  kept = (q, k, v, out, _softmax_statistics(q, k))
  named = tuple(
    jax.ad_checkpoint.checkpoint_name(a, f"flash_attention_{n}")
    for a, n in zip(kept, FLASH_NAMES, strict=True)
  )
  return out, named


def _flash_backward(kept, d_out):
  q, k, v, _, _ = kept
  return jax.vjp(_attention_xla, q, k, v)[1](d_out)


flash_attention.defvjp(_flash_forward, _flash_backward)


class FlashStandInStack(DecoderStack):
  """The benchmark's decoder stack with the flash-attention stand-in as its attention."""

  def _attend(self, q, k, v):
    return flash_attention(q, k, v)


def stock_model(shape_name: str, layers: int, attention: str) -> DecoderStack:
  shape = SHAPES[shape_name]
  if attention == "flash":
    return FlashStandInStack(shape, layers, attention=None)
  return DecoderStack(shape, layers, attention=attention)


@dataclasses.dataclass(frozen=True)
class Residual:
  dtype: str  # JAX's short name: bf16, f32, f8_e4m3fn, ...
  shape: tuple[int, ...]
  source: str  # the checkpoint name, else what made it and where, or the argument it is
  argument: bool  # one of the function's inputs (in memory anyway)

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * _bits(self.dtype) // 8


def _short_name(dtype) -> str:
  if dtype == jnp.bool_:
    return "bool"
  name = jnp.dtype(dtype).name
  for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
    name = name.replace(long, short)
  return name


_KNOWN_DTYPES = (
  jnp.bool_,
  jnp.bfloat16,
  jnp.float16,
  jnp.float32,
  jnp.float64,
  jnp.float8_e4m3fn,
  jnp.float8_e5m2,
  jnp.float8_e8m0fnu,
  jnp.float4_e2m1fn,
  jnp.int8,
  jnp.uint8,
  jnp.int16,
  jnp.uint16,
  jnp.int32,
  jnp.uint32,
  jnp.int64,
  jnp.uint64,
)
_BITS = {
  _short_name(d): (8 if d == jnp.bool_ else jnp.dtype(d).itemsize * 8) for d in _KNOWN_DTYPES
}
_BITS[_short_name(jnp.float4_e2m1fn)] = 4


def _bits(short_dtype: str) -> int:
  if short_dtype not in _BITS:
    raise ValueError(f"residual of unknown dtype {short_dtype!r}; known: {sorted(_BITS)}")
  return _BITS[short_dtype]


_LINE = re.compile(r"^(?P<dtype>[^\[\s]+)\[(?P<shape>[\d, ]*)\]\S*\s+(?P<source>.*)$")
_NAMED = re.compile(r"^named '(?P<name>[^']+)'")
# Group names leave out the folder a source path lies in: an installed package's
# (site-packages, even inside the repository, as CI's .venv), else the repository's root
# (benchmarks/step.py), else another folder on sys.path.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
_PATH = re.compile(
  "|".join(
    re.escape(folder.rstrip("/") + "/")
    for folder in sorted(
      {_ROOT} | {p for p in sys.path if p.startswith("/")},
      key=lambda p: ("-packages" not in p, p != _ROOT, -len(p)),
    )
  )
)


def _source(description: str) -> tuple[str, bool]:
  """(the group a residual's description names, whether it is an argument)."""
  named = _NAMED.match(description)
  if named:
    return named.group("name"), False
  if description.startswith("from the argument"):
    return description.removeprefix("from the "), True
  # "output of mul from /path/to/flax/linen/normalization.py:123:4 (_normalize)": the
  # path shortened to a package's or the repository's.
  return _PATH.sub("", description.removeprefix("output of ")), False


def saved_residuals(f, *args) -> list[Residual]:
  """f's residuals for its VJP w.r.t. all of args (arrays or jax.ShapeDtypeStruct), read
  from `jax.ad_checkpoint.print_saved_residuals`, JAX's public listing of them."""
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(f, *args)
  residuals = []
  for line in printed.getvalue().splitlines():
    match = _LINE.match(line)
    if not match:
      raise ValueError(f"unreadable residual line {line!r}")
    dims = match.group("shape").replace(" ", "")
    source, argument = _source(match.group("source"))
    residuals.append(
      Residual(
        match.group("dtype"),
        tuple(int(d) for d in dims.split(",")) if dims else (),
        source,
        argument,
      )
    )
  return residuals


@dataclasses.dataclass(frozen=True)
class Analysis:
  variant: str
  residuals: list[Residual]
  state_bytes: int  # params, grads and optimizer state (step.state_bytes)

  def total(self, *, argument: bool = False) -> int:
    return sum(r.bytes for r in self.residuals if r.argument == argument)

  def groups(self) -> dict[tuple[str, str, tuple[int, ...]], tuple[int, int]]:
    """(source, dtype, shape) -> (count, bytes), the largest first."""
    grouped = collections.defaultdict(lambda: [0, 0])
    for r in self.residuals:
      entry = grouped[r.source, r.dtype, r.shape]
      entry[0] += 1
      entry[1] += r.bytes
    return dict(sorted(((k, tuple(v)) for k, v in grouped.items()), key=lambda kv: -kv[1][1]))


def analyze(
  variant_name: str, shape_name: str, layers: int, batch: int, seq: int, attention: str
) -> Analysis:
  """The residuals of the step's loss for one variant, traced on abstract inputs."""
  shape = SHAPES[shape_name]
  variant = step_variants.build(variant_name, stock_model(shape_name, layers, attention))
  rngs = {"params": jax.random.key(0), "quant": jax.random.key(1)}
  init_x = jax.ShapeDtypeStruct((1, step.INIT_TOKENS, shape.d_model), jnp.bfloat16)
  model_collections = dict(jax.eval_shape(variant.model.init, rngs, init_x))
  params = model_collections.pop("params")
  opt_state = jax.eval_shape(optax.adamw(1e-4).init, params)
  x = jax.ShapeDtypeStruct((batch, seq, shape.d_model), jnp.bfloat16)
  loss_fn = step.loss_function(variant)
  key = jax.random.key(3)

  def loss(params, model_collections, x):
    return loss_fn(params, model_collections, jax.lax.stop_gradient(x), key)[0]

  return Analysis(
    variant_name,
    saved_residuals(loss, params, model_collections, x),
    step.state_bytes(params, opt_state),
  )


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f}"


def _gib(n: int) -> str:
  return f"{n / 2**30:.3f}"


def table(analysis: Analysis, baseline: Analysis | None, layers: int) -> str:
  """A markdown table of a variant's residual groups, each beside bf16's same group."""
  base = baseline.groups() if baseline else {}
  lines = [
    f"### {analysis.variant}",
    "",
    "| residual (checkpoint name, else producer and source) | dtype[shape] | count "
    "| MiB | MiB per layer | bf16 MiB |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for (source, dtype, shape), (count, size) in analysis.groups().items():
    kept = base.get((source, dtype, shape))
    where = source + (" (argument)" if source.startswith("argument") else "")
    lines.append(
      f"| {where} | {dtype}[{','.join(map(str, shape))}] | {count} | {_mib(size)} "
      f"| {_mib(size // layers)} | {_mib(kept[1]) if kept else '-'} |"
    )
  lines.append("")
  return "\n".join(lines)


def summary(analyses: list[Analysis]) -> str:
  """Totals per variant: computed residuals (vs bf16's), residual arguments, state."""
  base = next((a for a in analyses if a.variant == "bf16"), None)
  lines = [
    "| variant | residuals GiB | vs bf16 | residual arguments GiB | state GiB "
    "| state + residuals GiB |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for a in analyses:
    ratio = f"{a.total() / base.total():.3f}" if base and base.total() else "-"
    lines.append(
      f"| {a.variant} | {_gib(a.total())} | {ratio} | {_gib(a.total(argument=True))} "
      f"| {_gib(a.state_bytes)} | {_gib(a.state_bytes + a.total())} |"
    )
  return "\n".join(lines) + "\n"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
  parser.add_argument("--attention", choices=("flash", "xla", "cudnn"), default="flash")
  args = parser.parse_args(argv)
  args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = sorted(set(args.variants) - set(step_variants.ORDER))
  if unknown:
    parser.error(f"unknown variants {unknown}; variants are {list(step_variants.ORDER)}")
  return args


def main(argv=None) -> list[Analysis]:
  args = parse_args(argv)
  print(
    f"residuals of the step's loss at {args.shape} ({SHAPES[args.shape]}), {args.layers} "
    f"layers, {args.batch} x {args.seq} tokens, attention {args.attention}; jax {jax.__version__}"
  )
  names = list(dict.fromkeys(["bf16", *args.variants]))  # bf16 first: the baseline
  analyses = [
    analyze(n, args.shape, args.layers, args.batch, args.seq, args.attention) for n in names
  ]
  baseline = analyses[0]
  for a in analyses:
    if a.variant in args.variants:
      print(table(a, baseline if a is not baseline else None, args.layers))
  print(summary([a for a in analyses if a.variant in args.variants]))
  return analyses


if __name__ == "__main__":
  main()
