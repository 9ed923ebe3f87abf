"""Quantizer specs: validation, formats per usage, helpers, hashability under jit."""

from __future__ import annotations

import pytest

from jaxquant.formats import Family
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  for_usage,
  needs_key,
  needs_state,
)


@pytest.mark.parametrize(
  "make,match",
  [
    (lambda: Float8Quantizer("e3m4"), "'e3m4'"),
    (lambda: Float8Quantizer(eps=-1.0), "-1.0"),
    (lambda: DelayedFloat8Quantizer(history_len=0), "history_len.*0"),
    (lambda: DelayedFloat8Quantizer(amax_algo="mean"), "'mean'"),
    (lambda: DelayedFloat8Quantizer(margin=128), "margin.*\\[-149, 127\\].*128"),
    (lambda: BlockFloat8Quantizer(block="1x64"), "'1x64'"),
    (lambda: MXFP8Quantizer("e2m1"), "'e2m1'"),
    (lambda: NVFP4Quantizer(tile_2d=True, per_token=True), "per_token"),
    (lambda: NVFP4Quantizer(tile_2d=True, rht=True), "RHT"),
    (lambda: HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(per_token=True)), "per_token"),
  ],
)
def test_invalid_options_raise_value_error(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_options_of_the_wrong_type_raise_type_error():
  # More rows, for every option, in tests/test_bad_inputs.py.
  with pytest.raises(TypeError, match="margin.*0.5"):
    DelayedFloat8Quantizer(margin=0.5)


def test_hybrid_sides_must_be_base_quantizers():
  with pytest.raises(TypeError, match="rowwise"):
    HybridQuantizer("mxfp8", None)
  with pytest.raises(TypeError, match="columnwise"):
    HybridQuantizer(None, HybridQuantizer(None, None))


def test_formats_per_usage():
  assert Float8Quantizer("e5m2").format("rowwise").family is Family.FP8_TENSOR
  blk = BlockFloat8Quantizer(block="128x128").format("columnwise")
  assert blk.block == (128, 128) and blk.partial_blocks
  assert BlockFloat8Quantizer().format("columnwise").block == (1, 128)
  assert MXFP8Quantizer().format("columnwise").block == (1, 32)
  pt = NVFP4Quantizer(per_token=True)
  assert pt.format("rowwise").row_scaled and not pt.format("columnwise").row_scaled
  assert NVFP4Quantizer(tile_2d=True).format("rowwise").block == (16, 16)
  assert NVFP4Quantizer().format("rowwise").packed


def test_helpers():
  h = HybridQuantizer(DelayedFloat8Quantizer(), NVFP4Quantizer(stochastic_rounding=True))
  assert for_usage(h, "rowwise") == DelayedFloat8Quantizer()
  assert for_usage(MXFP8Quantizer(), "columnwise") == MXFP8Quantizer()
  assert needs_state(h) and needs_key(h)
  assert not needs_state(HybridQuantizer(None, MXFP8Quantizer())) and not needs_key(None)
  assert hash(h) == hash(
    HybridQuantizer(DelayedFloat8Quantizer(), NVFP4Quantizer(stochastic_rounding=True))
  )
