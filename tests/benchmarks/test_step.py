"""benchmarks/step.py and trace_summary.py on the CPU: the peers quantize the same GEMMs as
jaxquant's swap-in, a short run writes its records, and a profile's events are read and
categorized."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import step  # noqa: E402
import step_variants  # noqa: E402
import trace_summary as ts  # noqa: E402
from step_model import SHAPES, DecoderStack  # noqa: E402

LAYERS = 1
PROJECTIONS = 7  # q, k, v, o, gate, up, down


def _step_hlo(name, stock, params):
  variant = step_variants.build(name, stock)
  collections = step.variant_collections(variant, params, stock.shape.d_model)
  tx = optax.adamw(1e-4)
  x = jnp.ones((1, 128, stock.shape.d_model), jnp.bfloat16)
  lowered = jax.jit(step.train_step(variant, tx)).lower(
    params, tx.init(params), collections, x, jax.random.key(0)
  )
  return lowered.as_text()


def _dots(text):
  dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
  return len(dots), sum("f8E4M3FN" in d or "f8E5M2" in d for d in dots)


@pytest.fixture(scope="module")
def stock_and_params():
  stock = DecoderStack(SHAPES["tiny"], LAYERS, attention="xla")
  return stock, step.init_variables(stock, stock.shape.d_model)["params"]


@pytest.mark.parametrize("peer", ["flax_fp8", "qwix_fp8_tensor", "qwix_fp8_channel"])
def test_peers_quantize_every_projection_gemm_and_nothing_else(stock_and_params, peer):
  if peer.startswith("qwix"):
    pytest.importorskip("qwix")
  stock, params = stock_and_params
  total, f8 = _dots(_step_hlo(peer, stock, params))
  stock_total, stock_f8 = _dots(_step_hlo("bf16", stock, params))
  assert stock_f8 == 0
  assert total == stock_total  # the attention's dots are left alone ...
  assert f8 == 3 * PROJECTIONS * LAYERS  # ... every projection's fprop, dgrad and wgrad are FP8


def test_jaxquant_bf16_preset_is_the_stock_program(stock_and_params):
  import jaxquant.flax as jqf
  from jaxquant import recipes

  stock, params = stock_and_params
  swapped = DecoderStack(SHAPES["tiny"], LAYERS, attention="xla")
  variant = step_variants.Variant(
    "bf16", jqf.quantize_model(swapped, recipes.bf16), jqf.update_quant_state
  )
  tx = optax.adamw(1e-4)
  x = jnp.ones((1, 128, stock.shape.d_model), jnp.bfloat16)
  lower = lambda v: jax.jit(step.train_step(v, tx)).lower(
    params, tx.init(params), {}, x, jax.random.key(0)
  )
  strip = lambda t: re.sub(r"loc\([^)]*\)|#loc\d*[^\n]*", "", t)
  assert strip(lower(variant).as_text()) == strip(_step_hlo("bf16", stock, params))


@pytest.mark.parametrize("name", ["fp8_current_fast", "fp8_delayed_fast"])
def test_fast_variants_swap_in_their_preset_with_every_gemm_fast(stock_and_params, name):
  from jaxquant import recipes

  stock, _ = stock_and_params
  recipe = step_variants.build(name, stock).model.recipe
  preset = recipes.get(name.removesuffix("_fast"))
  assert recipe.name == name and recipe.fast_accumulation == frozenset(recipes.GEMMS)
  assert recipe.qfactory is preset.qfactory and recipe.backward == preset.backward


def test_a_short_run_records_every_metric(tmp_path):
  out = tmp_path / "step.json"
  step.main(
    [
      "--quick",
      "--layers",
      "1",
      "--only",
      "bf16,flax_fp8",
      "--rounds",
      "1",
      "--reps",
      "1",
      "--out",
      str(out),
    ]
  )
  records = json.loads(out.read_text())["records"]
  got = {(r["op"], r["metric"]) for r in records}
  assert {r["shape"] for r in records} == {"tiny"}
  memory = ("peak_gib", "activation_gib", "peak_donated_gib", "activation_donated_gib")
  for metric in ("step_ms", "compile_s", "speedup_vs_best_peer", *memory):
    assert ("step_bf16", metric) in got
  for metric in (
    "step_ms",
    "speedup_vs_bf16",
    "speedup_vs_bf16_lowest_round",
    "compile_s",
    "compile_vs_bf16",
    *memory,
    "activation_vs_bf16",
    "activation_donated_vs_bf16",
  ):
    assert ("step_flax_fp8", metric) in got
  assert ("step_flax_fp8", "speedup_vs_best_peer") not in got  # it is the best peer
  assert ("step_bf16", "activation_vs_bf16") not in got
  assert ("step_bf16", "activation_donated_vs_bf16") not in got
  # On the CPU XLA's reported peak leaves the temporaries out, so a donating step's is about
  # its arguments alone, less than the state's bytes (which count the gradients): its
  # activation figures are the one kind that may be negative here.
  assert all(r["value"] > 0 for r in records if "activation_donated" not in r["metric"])
  value = {(r["op"], r["metric"]): r["value"] for r in records}
  # One tiny layer: q and o d x d, k and v d x kv, gate, up and down d x ffn, two norms;
  # fp32 params, as many fp32 grads, AdamW's mu and nu (fp32) and its int32 step count.
  s = SHAPES["tiny"]
  kv = s.n_kv_heads * s.head_dim
  n_params = 2 * s.d_model**2 + 2 * s.d_model * kv + 3 * s.d_model * s.d_ff + 2 * s.d_model
  state_gib = (4 * 4 * n_params + 4) / 2**30
  for name in ("step_bf16", "step_flax_fp8"):
    for suffix in ("", "_donated"):
      peak, activation = value[name, f"peak{suffix}_gib"], value[name, f"activation{suffix}_gib"]
      # records keep 5 significant digits
      assert peak - activation == pytest.approx(state_gib, abs=1e-4 * peak)
    # Donated, the new params and optimizer state take the old ones' buffers.
    assert value[name, "peak_donated_gib"] < value[name, "peak_gib"]
  for suffix in ("", "_donated"):
    assert value["step_flax_fp8", f"activation{suffix}_vs_bf16"] == pytest.approx(
      value["step_flax_fp8", f"activation{suffix}_gib"]
      / value["step_bf16", f"activation{suffix}_gib"],
      rel=1e-4,
    )


def test_state_bytes_counts_params_grads_and_optimizer_state():
  params = {"a": jnp.zeros((3, 5), jnp.float32), "b": jnp.zeros((7,), jnp.bfloat16)}
  opt_state = optax.adamw(1e-4).init(params)
  abstract = jax.eval_shape(lambda: (params, opt_state))
  param_bytes = 3 * 5 * 4 + 7 * 2
  # grads as the params; mu and nu in the params' dtypes, plus an int32 count
  assert step.state_bytes(params, opt_state) == 2 * param_bytes + 2 * param_bytes + 4
  assert step.state_bytes(*abstract) == step.state_bytes(params, opt_state)


def test_unknown_variant_is_refused():
  with pytest.raises(SystemExit, match="unknown variants.*fp9"):
    step.selected_variants(step.parse_args(["--quick", "--only", "bf16,fp9"]))


def _event(name, start, duration, hlo_op=""):
  return ts.Event(name, start * 1e6, duration * 1e6, hlo_op)  # ms -> ns


def test_categories():
  targets = ts.custom_call_targets(
    "ENTRY %main {\n  %custom-call.3 = bf16[16,16]{1,0} custom-call(%a, %b), "
    'custom_call_target="jaxquant_fp8_tensor_gemm", api_version=API_VERSION_TYPED_FFI\n'
    "  ROOT cublas-gemm.1 = (bf16[16,16]{1,0}, s8[0]{0}) custom-call(%a, %b), "
    'custom_call_target="__cublas$gemm"\n}'
  )
  assert targets == {"custom-call.3": "jaxquant_fp8_tensor_gemm", "cublas-gemm.1": "__cublas$gemm"}
  expect = {
    (
      "void jaxquant::(anonymous namespace)::fp8_tensor_cast_kernel<__nv_bfloat16>(...)",
      "",
    ): "jaxquant cast, amax, dequantize",
    ("cutlass::device_kernel<jaxquant::grouped_gemm_detail::Kernel>", ""): "jaxquant GEMM",
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "custom-call.3"): "jaxquant GEMM",
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "cublas-gemm.1"): "XLA GEMM (cuBLAS, cuBLASLt)",
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", ""): "attention (cuDNN)",
    ("loop_transpose_fusion_2", ""): "copy / transpose",
    ("MemcpyD2D", ""): "copy / transpose",
    ("loop_multiply_fusion_4", "multiply_fusion.4"): "XLA fusion",
    ("loop_convert_fusion", "custom-call.3"): "XLA fusion",  # the op only splits GEMMs
    ("input_reduce_fusion", ""): "XLA fusion",
    ("Memset", ""): "other",
  }
  for (name, op), want in expect.items():
    assert ts.category(_event(name, 0, 1, op), targets) == want, name


def test_busy_idle_and_per_step_times():
  events = [
    _event("loop_add_fusion", 0, 10),
    _event("nvjet_a", 5, 10),  # streams overlap
    _event("loop_add_fusion", 20, 10),
    _event("Memset", 40, 0),
  ]  # zero length: dropped
  s = ts.summarize(events, steps=2)
  assert s["device_span_ms"] == pytest.approx(15.0)
  assert s["device_busy_ms"] == pytest.approx(12.5)
  assert s["idle_ms"] == pytest.approx(2.5)
  assert s["kernel_time_ms"] == pytest.approx(15.0)
  assert s["library_gemm_unattributed_ms"] == pytest.approx(5.0)  # nvjet_a names no op
  assert s["categories"]["XLA fusion"] == {
    "ms": pytest.approx(10.0),
    "share": pytest.approx(2 / 3),
    "kernels": 1.0,
  }
  assert s["top_kernels"][0] == {
    "name": "loop_add_fusion",
    "category": "XLA fusion",
    "ms": pytest.approx(10.0),
    "count": 1.0,
  }
  assert "idle (host gaps) ms | 2.50 |" in ts.markdown({"x": s})


@pytest.mark.skipif(
  not ts.XPLANE_READABLE,
  reason="jaxlib 0.12's ProfileData.from_file aborts "
  "the process on this trace; trace_summary reads the JSON trace there",
)
def test_a_real_trace_reads_alike_from_xplane_and_json(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      y = f(x)
    y.block_until_ready()
  xplane = next(tmp_path.rglob("*.xplane.pb"))
  trace_json = next(tmp_path.rglob("*.trace.json.gz"))
  from_xplane = ts._device_lines(ts._planes_from_xplane(xplane))
  from_json = ts._device_lines(ts._planes_from_trace_json(trace_json))
  assert from_xplane and all(e.hlo_op for e in from_xplane)
  ops = lambda events: sorted((e.name, e.hlo_op) for e in events)
  assert ops(from_xplane) == ops(from_json)
  events, source = ts.load_events(tmp_path)
  assert source == xplane.name and len(events) == len(from_xplane)
  assert ts.summarize(events, steps=2)["device_busy_ms"] > 0


def test_remat_quantized_keeps_each_layers_codes_and_its_param_tree(stock_and_params):
  from _remat_checks import saved_residuals

  stock, params = stock_and_params
  args = step.parse_args(["--quick", "--remat", "quantized"])
  remat = DecoderStack(
    SHAPES["tiny"], LAYERS, attention="xla", remat_policy=step.REMAT_POLICIES[args.remat]
  )
  variant = step_variants.build("fp8_current", remat)
  assert step.variant_collections(variant, params, stock.shape.d_model) == {}  # same params
  x = jnp.ones((1, 128, stock.shape.d_model), jnp.bfloat16)
  loss = lambda p, x: step.loss_function(variant)(p, {}, x, jax.random.key(0))[0]
  kept = [r for r in saved_residuals(loss, params, x) if not r.argument]
  codes = [r for r in kept if r.name == "jaxquant.input_codes"]
  assert len(codes) == PROJECTIONS * LAYERS and {r.dtype for r in codes} == {"f8_e4m3fn"}
  # Unnamed, the loss's own (2 y for its square) alone: no norm output, no SwiGLU product.
  assert [(r.dtype, r.shape) for r in kept if r.name is None] == [
    ("f32", (1, 128, stock.shape.d_model))
  ]
