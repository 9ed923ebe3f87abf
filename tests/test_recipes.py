"""Recipes: CustomRecipe validation, presets per role, get(), autocast and resolve."""

from __future__ import annotations

import pytest

from jaxquant import recipes
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)
from jaxquant.roles import QuantizerRole, gemm_roles


def test_custom_recipe_validation():
  with pytest.raises(TypeError, match="callable"):
    recipes.CustomRecipe("fp8")
  with pytest.raises(ValueError, match="'fp16'"):
    recipes.CustomRecipe(lambda r: None, backward="fp16")
  bad = recipes.CustomRecipe(lambda r: 3, name="bad")
  with pytest.raises(TypeError, match=r"3 .*grad_output.*attn/out"):
    bad.quantizer(QuantizerRole("linear", "grad_output", "attn/out"))
  with pytest.raises(ValueError, match="'bias'"):
    QuantizerRole("linear", "bias")


def test_quantizers_per_module():
  seen = []
  rec = recipes.CustomRecipe(
    lambda r: seen.append(r) or (None if r.tensor_type == "weight" else MXFP8Quantizer())
  )
  qs = rec.quantizers("linear", "mlp/wo")
  assert qs == {"input": MXFP8Quantizer(), "weight": None, "grad_output": MXFP8Quantizer()}
  assert seen == list(gemm_roles("linear", "mlp/wo").values())


@pytest.mark.parametrize(
  "name,want",
  [
    ("bf16", {"input": None, "weight": None, "grad_output": None}),
    (
      "fp8_current",
      {
        "input": Float8Quantizer("e4m3"),
        "weight": Float8Quantizer("e4m3"),
        "grad_output": Float8Quantizer("e5m2"),
      },
    ),
    (
      "fp8_delayed",
      {
        "input": DelayedFloat8Quantizer("e4m3"),
        "weight": DelayedFloat8Quantizer("e4m3"),
        "grad_output": DelayedFloat8Quantizer("e5m2"),
      },
    ),
    (
      "fp8_block",
      {
        "input": BlockFloat8Quantizer(),
        "weight": BlockFloat8Quantizer(block="128x128"),
        "grad_output": BlockFloat8Quantizer(),
      },
    ),
    ("mxfp8", {t: MXFP8Quantizer() for t in ("input", "weight", "grad_output")}),
    (
      "nvfp4",
      {
        "input": NVFP4Quantizer(rht=True),
        "weight": NVFP4Quantizer(tile_2d=True),
        "grad_output": NVFP4Quantizer(rht=True, stochastic_rounding=True),
      },
    ),
    (
      "hybrid",
      {
        "input": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
        "weight": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
        "grad_output": HybridQuantizer(
          MXFP8Quantizer(), NVFP4Quantizer(rht=True, stochastic_rounding=True)
        ),
      },
    ),
  ],
)
def test_presets(name, want):
  assert recipes.get(name).quantizers("linear", "x") == want


def test_get_unknown_and_autocast_resolve():
  with pytest.raises(ValueError, match="'fp6'"):
    recipes.get("fp6")
  assert recipes.resolve() is recipes.bf16
  with recipes.autocast(recipes.mxfp8):
    assert recipes.resolve(None) is recipes.mxfp8
    assert recipes.resolve(recipes.nvfp4) is recipes.nvfp4
  assert recipes.resolve() is recipes.bf16
