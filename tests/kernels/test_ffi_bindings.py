"""The Python kernels and the CUDA library's handlers agree, read from ffi/'s sources.

The kernel specs name the FFI targets (kernels/_targets.py collects them) and each config
its FFI attributes; the library declares one handler per target (handlers.h) and each handler binds
its attributes (an `.Attr<T>("name")` each, or an `.Attrs<Config>()` struct decoded by
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING). XLA rejects a call whose attributes differ from
the handler's binding, and a target without a handler fails only on a GPU: both are
checked here, on any machine, from the sources' text.
"""

from __future__ import annotations

import ctypes
import importlib
import pathlib
import pkgutil
import re

import numpy as np
import pytest

from jaxquant import kernels
from jaxquant.kernels import (
  _amax,
  _bf16_gemm,
  _block_gemm,
  _decode_scale,
  _delayed_scale,
  _dequantize,
  _fused_dequant,
  _gemm_values,
  _grouped,
  _targets,
  _tensor_gemm,
)
from jaxquant.kernels._config import cast_config
from jaxquant.kernels._library import WORKSPACE_QUERIES, handler_symbol
from jaxquant.kernels._primitive import KernelSpec
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

FFI = pathlib.Path(__file__).parents[2] / "ffi"
SOURCES = {p: p.read_text() for p in sorted(FFI.rglob("*")) if p.suffix in (".h", ".cuh", ".cu")}
CPP_TYPES = {np.int32: "int32_t", np.float32: "float", bool: "bool"}

_mxfp8 = MXFP8Quantizer().format("rowwise")
_nvfp4 = NVFP4Quantizer().format("rowwise")
# One config of every target, as its kernel builds them: each config class has one
# attribute set, whatever its values.
CONFIGS = {
  "jaxquant_amax": _amax.AmaxConfig(per_row=True),
  "jaxquant_fp8_tensor_cast": cast_config(DelayedFloat8Quantizer(), ("rowwise",)),
  "jaxquant_fp8_block_cast": cast_config(BlockFloat8Quantizer(), ("rowwise", "columnwise")),
  "jaxquant_mxfp8_cast": cast_config(MXFP8Quantizer(), ("rowwise",)),
  "jaxquant_nvfp4_cast": cast_config(NVFP4Quantizer(rht=True), ("rowwise", "columnwise")),
  "jaxquant_nvfp4_values": cast_config(NVFP4Quantizer(), ("columnwise",)),
  "jaxquant_mxfp8_values": _gemm_values.ValuesConfig("e4m3", True, True),
  "jaxquant_dequantize": _dequantize.DequantizeConfig(_nvfp4, "bfloat16"),
  "jaxquant_nvfp4_decode_scale": _decode_scale.DecodeScaleConfig(),
  "jaxquant_delayed_scale": _delayed_scale.DelayedScaleConfig(448.0, 1.0),
  "jaxquant_grouped_gemm": _grouped.GroupedGemmConfig("bfloat16"),
  "jaxquant_grouped_wgrad": _grouped.GroupedGemmConfig("float32"),
  "jaxquant_block_fp8_gemm": _block_gemm.BlockGemmConfig(128, "bfloat16"),
  "jaxquant_dequant_gemm": _fused_dequant.DequantGemmConfig(_mxfp8, _nvfp4, "bfloat16"),
  "jaxquant_fp8_tensor_gemm": _tensor_gemm.Fp8GemmConfig("bfloat16"),
  "jaxquant_scaled_bf16_gemm": _bf16_gemm.ScaledGemmConfig("float32"),
}


def test_targets_come_from_every_spec_of_the_package():
  specs = []
  for info in pkgutil.iter_modules(kernels.__path__, "jaxquant.kernels."):
    module = importlib.import_module(info.name)
    specs += [v for v in vars(module).values() if isinstance(v, KernelSpec)]
  assert sorted(s.name for s in specs) == sorted(s.name for s in _targets.SPECS)
  assert len(set(_targets.TARGETS)) == len(_targets.TARGETS)


def _closing_paren(text: str, open_at: int) -> int:
  depth = 0
  for i in range(open_at, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  raise ValueError(f"unbalanced parentheses from: {text[open_at : open_at + 80]}")


def _call_text(text: str, match: re.Match) -> str:
  """The arguments, in parentheses, of the macro call `match` starts."""
  open_at = text.index("(", match.start())
  return text[open_at : _closing_paren(text, open_at) + 1]


def _one(pattern: str, what: str) -> str:
  """The arguments of the one macro call in ffi/ that `pattern` finds."""
  found = [_call_text(t, m) for t in SOURCES.values() for m in re.finditer(pattern, t)]
  assert len(found) == 1, f"{len(found)} definitions of {what} in ffi/"
  return found[0]


def _struct_members(struct: str) -> dict[str, str]:
  body = _one(rf"XLA_FFI_REGISTER_STRUCT_ATTR_DECODING\(\s*(::)?(jaxquant::)?{struct}\s*,", struct)
  return {name: t for t, name in re.findall(r'StructMember<(\w+)>\(\s*"(\w+)"\s*\)', body)}


def _attributes(binding: str) -> dict[str, str]:
  """{name: C++ type} of the attributes a binding expression binds, through the helper
  functions it calls (bindings.h's `*_binding()`)."""
  attrs = {name: t for t, name in re.findall(r'\.Attr<(\w+)>\(\s*"(\w+)"\s*\)', binding)}
  for struct in re.findall(r"\.Attrs<(?:::)?(?:jaxquant::)?(\w+)>\(\)", binding):
    attrs.update(_struct_members(struct))
  for helper in re.findall(r"\b(\w+_binding)\(\)", binding):
    bodies = [
      m.group(1)
      for text in SOURCES.values()
      for m in re.finditer(rf"\bauto {helper}\(\) \{{(.*?)\n\}}", text, re.S)
    ]
    assert len(bodies) == 1, f"{len(bodies)} definitions of {helper}() in ffi/"
    attrs.update(_attributes(bodies[0]))
  return attrs


def test_every_target_has_a_config_here():
  assert sorted(_targets.TARGETS) == sorted(CONFIGS)


def test_handlers_h_declares_the_handler_of_every_target():
  header = SOURCES[FFI / "include/jaxquant/handlers.h"]
  declared = re.findall(r"^JAXQUANT_HANDLER\((\w+)\);", header, re.M)
  assert sorted(declared) == sorted(handler_symbol(t) for t in _targets.TARGETS)


def test_handlers_h_declares_the_workspace_queries():
  """The queries' argument types are what ctypes passes (kernels/_library.py)."""
  header = " ".join(SOURCES[FFI / "include/jaxquant/handlers.h"].split())
  declared = {
    name: re.findall(r"\b(\w+)\s+\w+(?:,|$)", args.strip())
    for name, args in re.findall(r"int64_t (\w+WorkspaceBytes)\(([^)]*)\);", header)
  }
  ctypes_names = {ctypes.c_int32: "int32_t", ctypes.c_int64: "int64_t"}
  python = {
    handler_symbol(target) + "WorkspaceBytes": [ctypes_names[t] for t in argtypes]
    for target, argtypes in WORKSPACE_QUERIES.items()
  }
  assert declared == python
  assert set(WORKSPACE_QUERIES) <= set(_targets.TARGETS)


@pytest.mark.parametrize("target", sorted(CONFIGS))
def test_handler_binds_the_config_attributes(target):
  symbol = handler_symbol(target)
  binding = _one(rf"\bJAXQUANT_DEFINE_HANDLER\(\s*{symbol}\s*,", f"the handler {symbol}")
  python = {k: CPP_TYPES[type(v)] for k, v in CONFIGS[target].ffi_attributes().items()}
  assert _attributes(binding) == python, f"{symbol}'s binding and {type(CONFIGS[target])}"
