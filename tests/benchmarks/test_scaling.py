"""benchmarks/scaling.py on the CPU's fake devices: the all-gather bytes are read from HLO
as XLA writes it, every param of the stack gets a rule, and a short run records every
layout and variant, the quantized gather moving fewer bytes than XLA's."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import scaling  # noqa: E402
import step  # noqa: E402
import trace_summary  # noqa: E402
from step_model import SHAPES, DecoderStack  # noqa: E402

HLO = """
  %all-gather = f32[256,512]{1,0} all-gather(f32[64,512]{1,0} %p), channel_id=1, dimensions={0}
  %ags = (bf16[2,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(bf16[2,8]{1,0} %q), dimensions={0}
  %agd = bf16[8,8]{1,0} all-gather-done((bf16[2,8]{1,0}, bf16[8,8]{1,0}) %ags)
  %agc = ((u8[2,4]{1,0}, f8e4m3fn[2,2]{1,0}), (u8[8,4]{1,0}, f8e4m3fn[8,2]{1,0})) \
all-gather-start(u8[2,4]{1,0} %a, f8e4m3fn[2,2]{1,0} %b)
  %ar = f32[1024]{0} all-reduce(f32[1024]{0} %r), to_apply=%add
  %fusion = bf16[9,9]{1,0} fusion(bf16[9,9]{1,0} %all-gather.1), kind=kLoop
"""


def test_all_gather_bytes_counts_each_gathered_result_once():
  # The synchronous gather's result, each start's results (not its operands, nor the
  # done's); no other collective, nor an op merely named after a gather.
  assert scaling.all_gather_bytes(HLO) == 256 * 512 * 4 + 8 * 8 * 2 + 8 * 4 + 8 * 2


def test_every_param_of_the_stack_has_a_sharding_rule():
  stock = DecoderStack(SHAPES["tiny"], 2, attention="xla")
  params = jax.eval_shape(lambda: step.init_variables(stock, stock.shape.d_model))["params"]
  specs = scaling.param_specs(params)
  flat = {
    jax.tree_util.keystr(path): spec
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))
  }
  assert flat["['layer_1_up_proj']['kernel']"] == P("fsdp", "tensor")
  assert flat["['layer_0_o_proj']['kernel']"] == P("tensor", "fsdp")
  assert flat["['layer_0_mlp_norm']['scale']"] == P()
  assert len(flat) == 2 * 9


def test_configs_take_the_layouts_each_device_count_allows():
  labels = [c.label("8b") for c in scaling.configs([2, 3, 4], list(scaling.LAYOUTS))]
  assert labels == [
    "8b one n=1",
    "8b fsdp n=2",
    "8b fsdp n=3",
    "8b fsdp n=4",
    "8b fsdp_tp n=2",
    "8b fsdp_tp n=4",
  ]


def event(name: str, op: str = "", ms: float = 1e-6, start_ms: float = 0.0) -> trace_summary.Event:
  return trace_summary.Event(name, start_ms * 1e6, ms * 1e6, op)


def test_peer_to_peer_copies_are_transfers_not_compute():
  assert scaling.collective_of(event("MemcpyP2P")) == "p2p_copy"
  assert scaling.collective_of(event("ncclDevKernel_AllGather_RING_LL")) == "all_gather"
  assert scaling.collective_of(event("fusion_12", "all-reduce.3")) == "all_reduce"
  assert scaling.collective_of(event("nvjet_sm90_tst_128x256", "custom-call.1")) is None


def test_compute_kernels_are_split_by_kind():
  assert scaling.compute_part_of(event("nvjet_sm90_tst_128x256", "custom-call.1")) == "compute_gemm"
  assert scaling.compute_part_of(event("void jaxquant::fp8_tensor_cast_kernel")) == "compute_cast"
  assert scaling.compute_part_of(event("cudnn_generated_sdpa_bprop")) == "compute_attention"
  assert scaling.compute_part_of(event("loop_add_fusion_5", "add_fusion")) == "compute_fusion"
  assert scaling.compute_part_of(event("input_transpose_fusion_7")) == "compute_copy"


def test_the_busiest_gemm_kernels_are_ranked_by_time_per_step_without_collectives():
  events = [
    event("nvjet_sm90_qqtst_176x128_ssched_bz_TNN", "custom-call.1", ms=3.0),
    event("nvjet_sm90_qqtst_176x128_ssched_bz_TNN", "custom-call.1", ms=3.0),
    event("nvjet_sm90_qrtst_128x160_bz_TNT", "custom-call.2", ms=4.0),
    event("ncclDevKernel_AllGather_RING_LL", ms=9.0),
    event("loop_add_fusion_5", "add_fusion", ms=8.0),
  ]
  busiest = scaling.busiest_gemm_kernels(events, steps=2, top=5)
  assert busiest == [
    ("nvjet_sm90_qqtst_176x128_ssched_bz_TNN", 3.0, 1.0),
    ("nvjet_sm90_qrtst_128x160_bz_TNT", 2.0, 0.5),
  ]
  assert scaling.busiest_gemm_kernels(events, steps=2, top=1) == busiest[:1]


def test_idle_time_is_the_span_in_which_no_kernel_runs():
  # Two steps: a GEMM beside a gather, then a 2 ms wait with nothing running, a fusion, a
  # cast inside the fusion's span (no gap), and 1 ms more with nothing before the last GEMM.
  events = [
    event("nvjet_sm90_qqtst_176x128_bz_TNN", "custom-call.1", ms=3.0, start_ms=0.0),
    event("ncclDevKernel_AllGather_RING_LL", ms=4.0, start_ms=1.0),
    event("loop_add_fusion_5", "add_fusion", ms=2.0, start_ms=7.0),
    event("void jaxquant::fp8_tensor_cast_kernel", ms=1.0, start_ms=7.5),
    event("nvjet_sm90_qqtst_176x128_bz_TNN", "custom-call.1", ms=2.0, start_ms=10.0),
  ]
  ms = scaling.profile_ms(events, steps=2)
  assert ms["idle"] == pytest.approx((2.0 + 1.0) / 2)
  assert ms["compute"] == pytest.approx((3.0 + 2.0 + 2.0) / 2)
  assert scaling.profile_ms([], steps=2)["idle"] == 0.0


def test_the_longest_idle_gaps_name_the_kernels_either_side():
  events = [
    event("gemm_a", ms=3.0, start_ms=0.0),
    event("nccl_gather", ms=4.0, start_ms=1.0),  # ends last: the gap after it is its
    event("fusion_b", ms=2.0, start_ms=7.0),
    event("cast_c", ms=1.0, start_ms=7.5),  # inside fusion_b: no gap around it
    event("gemm_d", ms=2.0, start_ms=10.0),
  ]
  assert scaling.longest_idle_gaps(events, top=5) == [
    (2.0, "nccl_gather", "fusion_b"),
    (1.0, "fusion_b", "gemm_d"),
  ]
  assert scaling.longest_idle_gaps(events, top=1) == [(2.0, "nccl_gather", "fusion_b")]
  assert scaling.longest_idle_gaps(events, top=0) == []


@pytest.mark.parametrize("flag", ["--top-kernels", "--top-gaps"])
def test_a_negative_number_of_top_kernels_or_gaps_is_refused(capsys, flag):
  with pytest.raises(SystemExit):
    scaling.parse_args([flag, "-1"])
  # The value and the rule, not argparse's "unrecognized arguments".
  assert f"{flag} -1: a number of" in capsys.readouterr().err


def test_a_run_of_several_processes_labels_its_records_apart():
  labels = [c.label("8b") for c in scaling.configs([4], ["fsdp"], processes=2)]
  assert labels == ["8b one n=1 p=2", "8b fsdp n=4 p=2"]


def test_a_short_run_records_every_layout_the_narrower_gather_and_shard_scaling(tmp_path):
  if len(jax.devices()) < 2:
    pytest.skip(f"needs 2 devices, {jax.default_backend()} has {len(jax.devices())}")
  out = tmp_path / "scaling.json"
  scaling.main(
    [
      "--quick",
      "--devices",
      "2",
      "--variants",
      "bf16,fp8_current,fp8_current_gather_shard",
      "--profile-steps",
      "1",
      "--top-kernels",
      "2",
      "--top-gaps",
      "2",
      "--out",
      str(out),
    ]
  )
  records = {
    (r["op"], r["shape"], r["metric"]): r["value"] for r in json.loads(out.read_text())["records"]
  }
  for label in ("tiny one n=1", "tiny fsdp n=2", "tiny fsdp_tp n=2"):
    for variant in ("bf16", "fp8_current"):
      assert records[f"scaling_{variant}", label, "tokens_per_s"] > 0
  # The quantized gather (with per-shard scaling) runs where weights are split over fsdp,
  # and only there: not on one device, nor beside tensor parallelism.
  variant = "fp8_current_gather_shard"
  assert (f"scaling_{variant}", "tiny fsdp n=2", "scaling_efficiency") in records
  assert not any(
    op == f"scaling_{variant}" and label != "tiny fsdp n=2" for op, label, _ in records
  )
  gathered = lambda variant: records[f"scaling_{variant}", "tiny fsdp n=2", "all_gather_gib"]
  # FP8 codes of each usage against XLA's gathers of the weights before they are quantized.
  assert 0 < gathered("fp8_current_gather_shard") < gathered("fp8_current")
  parts = ("all_gather", "reduce_scatter", "all_reduce", "p2p_copy", "compute", "idle")
  for label in ("tiny one n=1", "tiny fsdp n=2"):  # the one-device step is profiled too
    for part in parts + tuple(scaling.COMPUTE_PARTS):
      assert records["scaling_fp8_current", label, f"{part}_ms"] >= 0
  # The kinds split the compute's kernels: their own times add up to its busy time at least.
  kinds = sum(
    records["scaling_fp8_current", "tiny fsdp n=2", f"{p}_ms"] for p in scaling.COMPUTE_PARTS
  )
  assert kinds >= records["scaling_fp8_current", "tiny fsdp n=2", "compute_ms"] * 0.999
