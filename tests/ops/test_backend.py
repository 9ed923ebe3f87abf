"""The one reader of the backend choice (ops/_backend.py) and what it changes in the GEMM
dispatch: validation of JAXQUANT_BACKEND and JAXQUANT_DISABLE_KERNELS, and the route
`ops.gemm` would take on a GPU for each choice, chosen here without running it."""

import jax
import jax.numpy as jnp
import pytest

from jaxquant import kernels, reference
from jaxquant.formats import Family
from jaxquant.ops import _backend as backend_lib
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.ops import _grouped_gemm as grouped_gemm
from jaxquant.ops._backend import Backend, read_backend
from jaxquant.ops._delayed_state import divides_in_kernel
from jaxquant.ops._grouped_operands import GroupedOperand
from jaxquant.quantizers import Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer
from jaxquant.reference._grouped import group_layout


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
  monkeypatch.delenv(backend_lib.BACKEND_VAR, raising=False)
  monkeypatch.delenv(backend_lib.DISABLE_VAR, raising=False)


def test_kernel_names_are_those_jaxquant_kernels_exports():
  assert set(backend_lib.KERNELS) <= set(kernels.__all__)


def test_the_default_is_auto_with_nothing_disabled():
  got = read_backend()
  assert (got.choice, got.disabled, got.available) == ("auto", frozenset(), kernels.available())


def test_an_unknown_backend_is_an_error_naming_its_source(monkeypatch):
  with pytest.raises(ValueError, match=r"implementation='fast': must be one of"):
    read_backend("fast")
  monkeypatch.setenv("JAXQUANT_BACKEND", "nonsense")
  with pytest.raises(ValueError, match=r"JAXQUANT_BACKEND='nonsense': must be one of"):
    read_backend()
  assert read_backend("reference").choice == "reference"  # the argument first


def test_disabled_kernels_are_read_and_unknown_names_rejected(monkeypatch):
  monkeypatch.setenv("JAXQUANT_DISABLE_KERNELS", " fp8_tensor_gemm, amax ,")
  assert read_backend().disabled == {"fp8_tensor_gemm", "amax"}
  monkeypatch.setenv("JAXQUANT_DISABLE_KERNELS", "amax,fp8_gemm")
  with pytest.raises(ValueError, match=r"'amax,fp8_gemm'.*\['fp8_gemm'\].*fp8_tensor_gemm"):
    read_backend()


def test_allows_runs_and_binds():
  auto = Backend("auto", frozenset({"amax"}), available=True)
  assert auto.runs("delayed_scale") and auto.binds("delayed_scale")
  assert not auto.allows("amax") and not auto.runs("amax") and not auto.binds("amax")
  forced_on_cpu = Backend("kernel", frozenset(), available=False)
  assert forced_on_cpu.binds("quantize_usages") and not forced_on_cpu.runs("grouped_gemm")
  assert not Backend("reference", frozenset(), available=True).binds("quantize_usages")
  with pytest.raises(ValueError, match="unknown kernel 'cast'"):
    auto.allows("cast")


def _rowwise(quantizer, rows, k=256, element=jnp.bfloat16):
  x = jnp.zeros((rows, k), element)
  return jax.eval_shape(lambda: reference.quantize(x, quantizer, ("rowwise",)).rowwise)


def _route(a, b, disabled=(), choice="auto", out_dtype=jnp.float32):
  (side_a, k), (side_b, _) = gemm_ops._side_and_k(a), gemm_ops._side_and_k(b)
  problem = gemm_ops.Problem(side_a, side_b, k, jnp.dtype(out_dtype))
  return gemm_ops.select(problem, "gpu", Backend(choice, frozenset(disabled), True)).name


def test_disabling_a_gemm_kernel_takes_the_route_without_it():
  fp8 = _rowwise(Float8Quantizer(), 128)
  assert _route(fp8, fp8) == "fp8_tensor_gemm"
  assert _route(fp8, fp8, ["fp8_tensor_gemm"]) == "fp8_tensor_dot"
  assert _route(fp8, fp8, choice="reference") == "reference"
  short, long = _rowwise(MXFP8Quantizer(), 16), _rowwise(MXFP8Quantizer(), 128)
  assert _route(short, long) == "dequant_gemm"
  assert _route(long, short) == "dequant_gemm_transposed"
  assert _route(short, long, ["dequant_gemm"]) == "dequantize_first"
  assert _route(long, long, ["dequantize_data"]) == "xla_dot"
  assert _route(long, long, choice="reference") == "reference"
  assert _route(long, long, choice="kernel") == "dequantize_first"  # GEMMs: as "auto"


def test_the_route_tells_the_layer_its_operand_form():
  nvfp4 = NVFP4Quantizer().format("rowwise")
  mxfp8 = MXFP8Quantizer().format("rowwise")
  on_gpu = lambda *disabled: Backend("auto", frozenset(disabled), True)
  form = lambda a_rows, *disabled: gemm_ops.operand_form(
    nvfp4, mxfp8, a_rows, 128, 256, on_gpu(*disabled)
  )
  # Off a GPU no route dequantizes first.
  assert form(128) == gemm_ops.CODES
  select = gemm_ops.select
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gemm_ops, "select", lambda p, _, backend: select(p, "gpu", backend))
    assert form(128) == gemm_ops.VALUES
    assert form(16) == gemm_ops.CODES  # the fused-dequantize kernel reads codes
    assert form(16, "dequant_gemm") == gemm_ops.VALUES
    assert form(128, "dequantize_data") == gemm_ops.CODES


def test_values_take_values_on_every_platform_and_backend():
  values = gemm_ops.Side(gemm_ops.SCALED_VALUES, None, 128)
  matrix = gemm_ops.Side(gemm_ops.HIGH_PRECISION, None, 128)
  codes = gemm_ops.Side(Family.NVFP4, NVFP4Quantizer().format("rowwise"), 128)
  f32 = jnp.dtype(jnp.float32)
  for platform in ("cpu", "gpu"):
    for choice in backend_lib.BACKENDS:
      backend = Backend(choice, frozenset(), True)
      problem = gemm_ops.Problem(values, matrix, 256, f32)
      assert gemm_ops.select(problem, platform, backend).name == "scaled_values"
      with pytest.raises(TypeError, match="not codes"):
        gemm_ops.select(gemm_ops.Problem(values, codes, 256, f32), platform, backend)


def test_disabled_kernels_leave_the_other_ops_too(monkeypatch):
  monkeypatch.setattr(kernels, "available", lambda: True)
  assert divides_in_kernel()
  monkeypatch.setenv("JAXQUANT_DISABLE_KERNELS", "delayed_scale")
  assert not divides_in_kernel()
  # The grouped GEMM: the kernel's primitive is bound only where it is not disabled.
  layout = group_layout(jnp.array([64, 64], jnp.int32), 128)
  a, b = jnp.ones((128, 128), jnp.float32), jnp.ones((2, 128, 128), jnp.float32)
  bf16 = jnp.dtype(jnp.bfloat16)

  def jaxpr():
    def f(a, b):
      a_op = GroupedOperand(a, None, None, layout, bf16)
      b_op = GroupedOperand(b, None, None, None, bf16)
      return grouped_gemm.grouped_matmul(a_op, b_op), grouped_gemm.grouped_contract(a_op, a_op)

    return str(jax.make_jaxpr(f)(a, b))

  # Both groupings of the grouped kernel answer to its one name.
  monkeypatch.setenv("JAXQUANT_DISABLE_KERNELS", "grouped_gemm")
  assert "jaxquant_grouped" not in jaxpr()
  monkeypatch.delenv("JAXQUANT_DISABLE_KERNELS")
  assert "jaxquant_grouped_gemm" in jaxpr() and "jaxquant_grouped_wgrad" in jaxpr()
