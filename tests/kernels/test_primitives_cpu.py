"""The kernel primitives off the GPU: reference lowering, vmap, sharding, validation.

These run everywhere (CI included): on the CPU each primitive lowers to the reference, so
what is checked is the primitive machinery, the layouts and the partitioning rules.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_cases import DELAYED, QUANTIZERS, SR_QUANTIZERS, assert_same_bits, random_input

from jaxquant import kernels, reference, scaling
from jaxquant.kernels._config import cast_config
from jaxquant.ops import _quantize as ops
from jaxquant.ops._backend import read_backend
from jaxquant.quantizers import BlockFloat8Quantizer, MXFP8Quantizer, NVFP4Quantizer

# One per code path; compiling the reference dominates on the CPU.
CPU_CASES = {
  name: dict(QUANTIZERS, **SR_QUANTIZERS)[name]
  for name in (
    "fp8_e4m3",
    "block_128x128",
    "mxfp8_e5m2",
    "nvfp4_per_token_rht",
    "nvfp4_16x16_sr",
    "hybrid_mxfp8_nvfp4",
  )
}


@functools.partial(jax.jit, static_argnames=("quantizer", "implementation"))
def quantize_jit(x, key, *, quantizer, implementation):
  return ops.quantize(x, quantizer, key=key, implementation=implementation)


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_reference_lowering_matches_reference(name):
  # On the CPU the kernel primitives lower to the reference; with a threefry key even the
  # stochastic rounding bits match. (On a GPU the CUDA kernels run: test_kernels_gpu.py.)
  if kernels.available():
    pytest.skip("the CUDA kernels run here; they are compared in test_kernels_gpu.py")
  x = random_input(1, (64, 128), jnp.bfloat16)
  key = jax.random.key(4)
  assert_same_bits(
    quantize_jit(x, key, quantizer=CPU_CASES[name], implementation="kernel"),
    quantize_jit(x, key, quantizer=CPU_CASES[name], implementation="reference"),
    name,
  )


@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8_e4m3"])
def test_vmap_quantizes_each_element_separately(name):
  q = QUANTIZERS[name]
  xs = jnp.stack([random_input(s, (32, 64), jnp.float32) * (s + 1) for s in range(3)])
  batched = jax.jit(jax.vmap(lambda x: kernels.quantize_usages(x, q, ("rowwise", "columnwise"))))(
    xs
  )
  for i in range(3):
    one = kernels.quantize_usages(xs[i], q, ("rowwise", "columnwise"))
    assert_same_bits(jax.tree.map(lambda a, i=i: a[i], batched), one, f"{name} vmap element {i}")


def _mesh(devices):
  return Mesh(np.array(devices).reshape(2, 4), ("a", "b"))


# Not RHT here: on the CPU the reference's exact-arithmetic host callback (which RHT sums
# of small values reach) deadlocks against the amax pmax across 8 fake devices (XLA
# rendezvous timeout), a reference/XLA:CPU limit; the GPU kernels have no callback.
@pytest.mark.parametrize(
  "name,spec",
  [
    ("fp8_e4m3", P("a", "b")),
    ("mxfp8_e4m3", P(None, "b")),
    ("mxfp8_e4m3", P(("a", "b"), None)),
    ("nvfp4_per_token", P("a", "b")),
    ("nvfp4_16x16", P("a", "b")),
  ],
  ids=str,
)
def test_sharded_matches_unsharded(name, spec, eight_devices):
  q = QUANTIZERS[name]
  x = random_input(2, (512, 1024), jnp.bfloat16)
  want = kernels.quantize_usages(x, q, ("rowwise", "columnwise"))
  mesh = _mesh(eight_devices)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  f = jax.jit(lambda x: kernels.quantize_usages(x, q, ("rowwise", "columnwise")))
  got = f(xs)
  assert_same_bits(got, want, f"{name} sharded {spec}")
  hlo = f.lower(xs).compile().as_text()
  # Blocks stay whole within a shard: the input (a bf16 matrix) is never gathered.
  assert not re.search(r"bf16\[\d+,\d+\][^ ]* all-gather", hlo), f"{name} {spec}: input gathered"
  padded = lambda s: tuple(s) + (None,) * (2 - len(tuple(s)))
  assert padded(got["rowwise"].data.sharding.spec) == padded(spec)


@pytest.mark.parametrize(
  "usages", [("rowwise", "columnwise"), ("rowwise",), ("columnwise",)], ids="+".join
)
def test_delayed_cast_observes_the_global_amax(usages, eight_devices):
  """Delayed scaling's cast also returns the amax it read (the step records it): the
  reference's abs_max of the whole matrix, one device or sharded (each shard's, pmax-ed)."""
  x = random_input(6, (256, 512), jnp.bfloat16).at[200, 17].set(-3e4)
  scale = jnp.float32(0.25)
  cast = jax.jit(lambda x: kernels.quantize_usages_and_amax(x, DELAYED, usages, scale=scale))
  want_data, want_amax = cast(x)
  assert_same_bits(want_amax, reference.fp32.abs_max(x.astype(jnp.float32)), "amax, one device")
  assert_same_bits(want_data, kernels.quantize_usages(x, DELAYED, usages, scale=scale), "data")
  xs = jax.device_put(x, NamedSharding(_mesh(eight_devices), P("a", "b")))
  got_data, got_amax = cast(xs)
  assert_same_bits(got_amax, want_amax, "amax, sharded")
  assert_same_bits(got_data, want_data, "data, sharded")
  assert kernels.quantize_usages_and_amax(x, QUANTIZERS["fp8_e4m3"], usages)[1] is None


def test_sharded_amax_is_global(eight_devices):
  x = random_input(3, (256, 512), jnp.float32).at[17, 300].set(1e6)
  xs = jax.device_put(x, NamedSharding(_mesh(eight_devices), P("a", "b")))
  got = jax.jit(kernels.amax)(xs)
  assert float(got) == 1e6
  rows = jax.jit(functools.partial(kernels.amax, per_row=True))(xs)
  assert_same_bits(rows, reference.fp32.abs_max(x, axis=1), "per-row amax sharded")


def _abs_max_oracle(x: np.ndarray) -> np.float32:
  """max |x| in float64 from the values, NaN if any is NaN."""
  values = np.abs(np.asarray(x, np.float64))
  return np.float32(np.nan) if np.isnan(values).any() else np.float32(values.max(initial=0.0))


@pytest.mark.parametrize(
  "dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name
)
def test_tensor_amax_against_an_oracle(dtype, eight_devices):
  """kernels.amax.tensor_amax (XLA's reduction of x's own bits) on random values, signed
  zeros, subnormals of the dtype, infinities, NaNs of any payload (the canonical NaN
  out), an empty matrix, and sharded over eight devices."""
  from jaxquant.kernels._amax import tensor_amax

  rng = np.random.default_rng(4)
  tiny = float(jnp.finfo(dtype).smallest_subnormal)
  cases = {
    "random": random_input(5, (64, 96), dtype),
    "zeros": jnp.asarray(np.where(rng.random((16, 32)) < 0.5, -0.0, 0.0), dtype),
    "subnormals": jnp.asarray(rng.integers(-9, 10, (16, 32)) * tiny, dtype),
    "inf": random_input(6, (16, 32), dtype).at[3, 4].set(-jnp.inf),
    "empty": jnp.zeros((0, 32), dtype),
  }
  for name, x in cases.items():
    want = _abs_max_oracle(np.asarray(x, np.float32))
    assert_same_bits(jax.jit(tensor_amax)(x), jnp.float32(want), f"tensor_amax {name}")
  # A NaN with a payload and the sign bit set: the canonical NaN comes out.
  width = {2: np.uint16, 4: np.uint32}[jnp.dtype(dtype).itemsize]
  nan_bits = {
    jnp.dtype(jnp.bfloat16): 0xFFA1,
    jnp.dtype(jnp.float16): 0xFE01,
    jnp.dtype(jnp.float32): 0xFFA00001,
  }[jnp.dtype(dtype)]
  x = np.asarray(random_input(7, (16, 32), dtype)).view(width).copy()
  x[5, 6] = nan_bits
  got = jax.jit(tensor_amax)(jnp.asarray(x.view(jnp.dtype(dtype))))
  assert np.asarray(got).view(np.uint32) == 0x7FC00000
  x = random_input(8, (256, 512), dtype).at[17, 300].set(-1000.0)
  xs = jax.device_put(x, NamedSharding(_mesh(eight_devices), P("a", "b")))
  assert_same_bits(jax.jit(tensor_amax)(xs), jnp.float32(1000.0), "tensor_amax sharded")
  with pytest.raises(TypeError, match="int32"):
    tensor_amax(jnp.zeros((4, 4), jnp.int32))


def test_decode_scale_primitive_one_device_sharded_and_batched(eight_devices):
  """On the CPU the decode-scale primitive lowers to the reference: the same S_decs for a
  vector, split over eight devices, under vmap and for a scalar; bad amaxes are refused.
  Subnormal amaxes and S_decs only on one device: there the reference's exact arithmetic
  takes a host callback, which crashes XLA:CPU across eight fake devices."""
  edges = jnp.float32([0.0, -0.0, np.inf, 1e-45, 3.4028235e38, 2688.0])
  assert_same_bits(
    jax.jit(kernels.decode_scale)(edges), reference.nvfp4.global_scales(edges)[1], "edge amaxes"
  )
  amaxes = (
    jnp.float32(np.random.default_rng(4).lognormal(0.0, 10.0, 64))
    .at[:2]
    .set(jnp.float32([0.0, np.inf]))
  )
  want = reference.nvfp4.global_scales(amaxes)[1]
  assert_same_bits(jax.jit(kernels.decode_scale)(amaxes), want, "one device")
  sharded = jax.device_put(amaxes, NamedSharding(_mesh(eight_devices), P(("a", "b"))))
  got = jax.jit(kernels.decode_scale)(sharded)
  assert_same_bits(got, want, "sharded")
  assert got.sharding.spec == P(("a", "b"))
  assert_same_bits(
    jax.vmap(kernels.decode_scale)(amaxes.reshape(4, 16)), want.reshape(4, 16), "vmap"
  )
  assert_same_bits(kernels.decode_scale(amaxes[5]), want[5], "scalar")
  with pytest.raises(ValueError, match="NVFP4 global amax"):
    kernels.decode_scale(amaxes.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="a scalar or a vector"):
    kernels.decode_scale(amaxes.reshape(8, 8))


def test_nvfp4_gemm_lowers_both_decode_scales_to_one_kernel_call(cuda_library_stand_in):
  """For CUDA, an NVFP4 GEMM that dequantizes first takes both operands' S_dec from one
  decode-scale call and inlines no exact-division emulation (reference.fp32's integer long
  division, which set a quantized step's compile time when every GEMM inlined it).
  Lowered without a GPU: the library is stood in for."""
  from jaxquant.ops import _gemm as gemm_ops

  operand = lambda rows, name: jax.eval_shape(
    lambda: reference.quantize(jnp.zeros((rows, 256), jnp.bfloat16), QUANTIZERS[name]).rowwise
  )
  for a, b in (
    (operand(128, "nvfp4"), operand(64, "nvfp4")),
    (operand(128, "nvfp4_per_token"), operand(64, "nvfp4")),
  ):
    text = (
      jax.jit(gemm_ops._dequantize_first_gemm)
      .trace(a, b)
      .lower(lowering_platforms=("cuda",))
      .as_text()
    )
    assert text.count("@jaxquant_nvfp4_decode_scale(") == 1, text
    assert "_div_exact" not in text


def test_delayed_scale_primitive_one_device_sharded_and_batched(eight_devices):
  """On the CPU the delayed-scale primitive lowers to the reference: the same next scales
  for a vector, split over eight devices, under vmap and for a scalar; bad inputs are
  refused. Subnormal amaxes only on one device (the reference's exact arithmetic takes a
  host callback there, which crashes XLA:CPU across eight fake devices)."""
  fmax, divisor = 448.0, 8.0
  next_scale = lambda a, s: kernels.delayed_scale(a, s, fmax, divisor)
  edges = jnp.float32([0.0, -0.0, np.inf, np.nan, 1e-45, 3.4028235e38])
  old = jnp.float32([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
  assert_same_bits(
    jax.jit(next_scale)(edges, old), scaling.next_scale(edges, old, fmax, divisor), "edge amaxes"
  )
  rng = np.random.default_rng(5)
  amaxes = jnp.float32(rng.lognormal(0.0, 10.0, 64)).at[:3].set(jnp.float32([0.0, np.inf, np.nan]))
  scales = jnp.float32(rng.lognormal(0.0, 3.0, 64))
  want = scaling.next_scale(amaxes, scales, fmax, divisor)
  assert not np.array_equal(want, scales) and np.array_equal(want[:3], scales[:3])
  assert_same_bits(jax.jit(next_scale)(amaxes, scales), want, "one device")
  spec = NamedSharding(_mesh(eight_devices), P(("a", "b")))
  got = jax.jit(next_scale)(jax.device_put(amaxes, spec), jax.device_put(scales, spec))
  assert_same_bits(got, want, "sharded")
  assert got.sharding.spec == P(("a", "b"))
  assert_same_bits(
    jax.vmap(next_scale)(amaxes.reshape(4, 16), scales.reshape(4, 16)), want.reshape(4, 16), "vmap"
  )
  assert_same_bits(next_scale(amaxes[5], scales[5]), want[5], "scalar")
  with pytest.raises(ValueError, match="delayed-scaling amax"):
    next_scale(amaxes.astype(jnp.bfloat16), scales)
  with pytest.raises(ValueError, match="delayed scale: expected float32\\[64\\]"):
    next_scale(amaxes, scales[:8])
  with pytest.raises(ValueError, match="a scalar or a vector"):
    next_scale(amaxes.reshape(8, 8), scales.reshape(8, 8))


def _two_layer_delayed_step():
  """A two-Dense fp8_delayed model's state after one forward pass, and its gradient."""
  from flax import linen as nn

  from jaxquant import recipes
  from jaxquant.flax import quantize_model

  model = quantize_model(nn.Sequential([nn.Dense(64), nn.Dense(64)]), recipes.get("fp8_delayed"))
  x = jax.random.normal(jax.random.key(1), (8, 64)) * 3.0
  variables = model.init(jax.random.key(0), x)

  def loss(params, state):
    y, updated = model.apply({"params": params, "quant_state": state}, x, mutable=["quant_state"])
    return jnp.sum(jnp.square(y)), updated["quant_state"]

  (_, updated), (_, grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
    variables["params"], variables["quant_state"]
  )
  return updated, grads


def test_delayed_update_lowers_each_state_to_its_own_kernel_call(
  monkeypatch, cuda_library_stand_in
):
  """For CUDA, a Linen model's delayed-scaling update takes each state's next scale from a
  delayed-scale call of its own (two layers, three roles each) and inlines no exact-division
  emulation. Lowered without a GPU: the library is stood in for."""
  from jaxquant.flax import update_quant_state

  monkeypatch.setattr(kernels, "available", lambda: True)
  state, grads = jax.eval_shape(_two_layer_delayed_step)
  text = (
    jax.jit(update_quant_state).trace(state, grads).lower(lowering_platforms=("cuda",)).as_text()
  )
  assert text.count("@jaxquant_delayed_scale(") == 6, text
  assert "_div_exact" not in text


def test_delayed_update_per_state_is_the_grouped_update(monkeypatch):
  """Where the kernel divides (here its CPU lowering, the reference), each state updates on
  its own; the bits are those of the grouped update without the kernel, for the states of
  one step and for the same states stacked as nn.scan stacks a layer's (one per layer)."""
  from jaxquant.flax import update_quant_state
  from jaxquant.ops._delayed_state import divides_in_kernel

  state, grads = jax.jit(_two_layer_delayed_step)()  # one program, not op by op
  layers = lambda tree: jax.tree.map(lambda a: jnp.stack([a, a * 3.0, a * 0.25]), tree)
  cases = {"plain": (state, grads), "stacked": (layers(state), layers(grads))}
  # A new function each time: jit caches traces by function, and the kernel's availability
  # is read while tracing.
  update = lambda: jax.jit(lambda s, g: update_quant_state(s, g))
  want = {name: update()(*args) for name, args in cases.items()}
  monkeypatch.setattr(kernels, "available", lambda: True)
  assert divides_in_kernel()
  for name, args in cases.items():
    jaxpr = str(jax.make_jaxpr(lambda s, g: update_quant_state(s, g))(*args))
    assert jaxpr.count("jaxquant_delayed_scale") == 6, name  # grouped: one call a group, 2
    got = update()(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want[name]), strict=False):
      assert_same_bits(g, w, name)
  scales = [leaf for leaf in jax.tree.leaves(want["plain"]) if leaf.ndim == 1]
  assert any(not np.array_equal(s, 1.0) for s in scales)  # the update moved some scale


DEQUANTIZE_SHARDED_CASES = [
  # (quantizer, usage, spec, whole): whole = every shard holds whole blocks, nothing gathered
  ("mxfp8_e4m3", "rowwise", P("a", "b"), True),
  ("mxfp8_e4m3", "columnwise", P(None, ("a", "b")), True),
  ("nvfp4_per_token", "rowwise", P("a", "b"), True),
  ("nvfp4_16x16", "rowwise", P("a", "b"), True),
  ("block_128x128", "rowwise", P(("a", "b"), None), False),  # 128-row tiles over 8 shards of 64
  ("fp8_e4m3", "rowwise", P("b", "a"), True),
]


@pytest.mark.parametrize("name,usage,spec,whole", DEQUANTIZE_SHARDED_CASES, ids=str)
@pytest.mark.parametrize("block_scales_only", [False, True], ids=["all_scales", "block_scales"])
@pytest.mark.slow
def test_sharded_dequantize(name, usage, spec, whole, block_scales_only, eight_devices):
  """Each device dequantizes its shard (same bits as one device) and keeps the operand's
  sharding wherever whole scaling blocks allow; tiles a shard would split are gathered."""
  if block_scales_only and name.startswith("fp8_"):
    pytest.skip("per-tensor FP8 has no block scales")
  q = QUANTIZERS[name]
  stored = getattr(reference.quantize(random_input(5, (512, 1024), jnp.bfloat16), q), usage)
  f = jax.jit(
    lambda qd: kernels.dequantize_data(qd, jnp.bfloat16, block_scales_only=block_scales_only)
  )
  want = f(stored)
  mesh = _mesh(eight_devices)

  def place(array, array_spec):  # replicated where the spec does not divide the array
    try:
      return jax.device_put(array, NamedSharding(mesh, array_spec))
    except ValueError:
      return jax.device_put(array, NamedSharding(mesh, P()))

  amax = stored.amax
  placed = stored.__class__(
    place(stored.data, spec),
    place(stored.scale_inv, spec),
    None if amax is None else place(amax, P(*spec[: amax.ndim])),
    stored.format,
  )
  got = f(placed)
  assert_same_bits(got, want, f"dequantize {name} {usage} {spec}")
  # The stored codes must not be gathered (matched by their full shape: XLA:CPU widens FP8
  # to f16 for collectives; the reference's exact-product host callback gathers fp32).
  rows, cols = stored.data.shape
  hlo = f.lower(placed).compile().as_text()
  gathered = re.search(rf"(f8\w+|u8|f16)\[{rows},{cols}\][^ ]* all-gather", hlo)
  assert bool(gathered) != whole, f"{name} {spec}: codes gathered={bool(gathered)}"
  if whole:
    padded = lambda s: tuple(s) + (None,) * (2 - len(tuple(s)))
    assert padded(got.sharding.spec) == padded(spec)


def test_dequantize_block_scales_only_leaves_s_dec_out():
  """The values a GEMM multiplies: NVFP4 without S_dec (reference.split_scales), every
  other family as the full dequantization."""
  x = random_input(6, (64, 128), jnp.bfloat16) * 1e3
  names = ("nvfp4", "nvfp4_per_token", "mxfp8_e5m2", "block_1x128")

  block_scales_only = lambda qd: kernels.dequantize_data(qd, jnp.float32, block_scales_only=True)

  # One program: eagerly, the reference NVFP4 cast compiles op by op (seconds a shape on a
  # CPU), and a program a format would compile the shared parts again.
  @jax.jit
  def got_and_want(x):
    stored = {name: reference.quantize(x, QUANTIZERS[name]).rowwise for name in names}
    got = {name: block_scales_only(qd) for name, qd in stored.items()}
    return got, {name: reference.split_scales(qd)[0] for name, qd in stored.items()}

  got, want = got_and_want(x)
  for name in names:
    assert_same_bits(got[name], want[name], f"{name} block scales only")
  # Traced only: the check reads the format.
  fp8 = jax.eval_shape(lambda x: reference.quantize(x, QUANTIZERS["fp8_e4m3"]).rowwise, x)
  with pytest.raises(ValueError, match="per-tensor FP8"):
    jax.eval_shape(block_scales_only, fp8)


def test_cast_config_options():
  c = cast_config(
    NVFP4Quantizer(rht=True, stochastic_rounding=True, per_token=True), ("rowwise", "columnwise")
  )
  assert c.rht and c.stochastic_rounding and c.format.row_scaled
  assert not c.usage_format("columnwise").row_scaled
  # Columnwise alone: no row scales (they belong to the rowwise usage).
  assert not cast_config(NVFP4Quantizer(per_token=True), ("columnwise",)).format.row_scaled


# ---------------------------------------------------------------- errors in Python


def test_bad_dims_rejected_with_the_rule():
  x = jnp.zeros((64, 48), jnp.bfloat16)
  with pytest.raises(ValueError, match="divisible by its block 32"):
    kernels.quantize_usages(x, MXFP8Quantizer(), ("rowwise",))


def test_kernel_limits_rejected_when_forced():
  # Block FP8 allows partial blocks; the kernel needs dims that fill 16-byte vectors.
  x = jnp.zeros((64, 200), jnp.bfloat16)
  with pytest.raises(ValueError, match="divisible by 16"):
    ops.quantize(x, BlockFloat8Quantizer(), implementation="kernel")
  # "auto" takes the reference for what the kernels do not cover (traced, not compiled).
  jax.eval_shape(lambda x: ops.quantize(x, BlockFloat8Quantizer(), implementation="auto"), x)


def test_bad_inputs_rejected():
  with pytest.raises(TypeError, match="int32"):
    kernels.amax(jnp.zeros((16, 16), jnp.int32))
  with pytest.raises(ValueError, match="matrix"):
    kernels.amax(jnp.zeros((16,), jnp.float32))
  with pytest.raises(ValueError, match="multiple of 16"):
    kernels.amax(jnp.zeros((8, 16), jnp.float32), rht=True)
  with pytest.raises(ValueError, match="key"):
    kernels.quantize_usages(
      jnp.zeros((16, 16), jnp.float32), NVFP4Quantizer(stochastic_rounding=True), ("rowwise",)
    )
  qt = jax.eval_shape(lambda x: reference.quantize(x, MXFP8Quantizer()), jnp.ones((32, 32)))
  half_rows = jax.ShapeDtypeStruct((16, 32), qt.rowwise.data.dtype)  # scales still for 32 rows
  bad = qt.rowwise.__class__(half_rows, qt.rowwise.scale_inv, None, qt.rowwise.format)
  with pytest.raises(ValueError, match="dequantize scales"):
    kernels.dequantize_data(bad, jnp.float32)


def test_implementation_switch(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "nonsense")
  with pytest.raises(ValueError, match="JAXQUANT_BACKEND"):
    ops.quantize(jnp.ones((32, 32)), MXFP8Quantizer())
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  assert read_backend(None).choice == "reference"
  assert read_backend("kernel").choice == "kernel"


def test_availability_is_explained():
  if kernels.available():
    pytest.skip("kernels available here")
  assert isinstance(kernels.unavailable_reason(), str) and kernels.unavailable_reason()


def test_cuda_lowering_adds_the_workspace_result(monkeypatch):
  """A kernel with a workspace lowers, for CUDA, to an FFI call with one more uint8 result of
  the size its query gives (XLA allocates it with the call); the primitive's results are
  unchanged. Lowered here without a GPU: the library's load and query are stood in for."""
  from jaxquant.kernels import _grouped as grouped
  from jaxquant.kernels import _library as library

  queries = []
  monkeypatch.setattr(library, "register", lambda targets: None)
  monkeypatch.setattr(
    library,
    "workspace_bytes",
    lambda target, *dims: queries.append((target, dims)) or 1000 + dims[0],
  )
  a, b = jnp.zeros((64, 32), jnp.bfloat16), jnp.zeros((3, 16, 32), jnp.bfloat16)
  sizes, alpha = jnp.zeros((3,), jnp.int32), jnp.ones((3,), jnp.float32)
  fn = jax.jit(lambda *args: grouped.grouped_gemm(*args, out_dtype=jnp.float32))
  text = fn.trace(a, b, sizes, alpha).lower(lowering_platforms=("cuda",)).as_text()
  (call,) = [line for line in text.splitlines() if "@jaxquant_grouped_gemm" in line]
  assert call.endswith("-> (tensor<64x16xf32>, tensor<1003xui8>)"), call
  assert queries == [("jaxquant_grouped_gemm", (3,))]
  assert jax.eval_shape(fn, a, b, sizes, alpha).shape == (64, 16)


@pytest.mark.parametrize("across_devices", [False, True], ids=["one_device", "eight_devices"])
@pytest.mark.parametrize("gemm", ["fp8_tensor_gemm", "scaled_bf16_gemm"])
def test_cublaslt_gemms_take_cublaslt_s_workspace_across_devices(
  monkeypatch, eight_devices, gemm, across_devices
):
  """The GEMMs that are one cuBLASLt call take its workspace as a result buffer sized by
  D's shape where the computation spans several devices (without one cuBLASLt runs
  statically scheduled kernels, which lose more beside NCCL's; ffi/gemm/fp8_tensor_gemm.cu),
  and on one device have D as their only result, which XLA's fusions may then overwrite
  in place. Lowered here without a GPU: the library's load and query are stood in for."""
  from jaxquant.kernels import _bf16_gemm as bf16_gemm
  from jaxquant.kernels import _library as library
  from jaxquant.kernels import _tensor_gemm as tensor_gemm

  queries = []
  monkeypatch.setattr(library, "register", lambda targets: None)
  monkeypatch.setattr(
    library, "workspace_bytes", lambda target, *dims: queries.append((target, dims)) or 777
  )
  m, n, k = 64, 48, 32
  if gemm == "fp8_tensor_gemm":
    a = jnp.zeros((m, k), jnp.float8_e4m3fn)
    b = jnp.zeros((n, k), jnp.float8_e4m3fn)
    call = lambda a, b, s: tensor_gemm.fp8_tensor_gemm(a, b, s, s, out_dtype=jnp.bfloat16)
  else:
    a, b = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((n, k), jnp.bfloat16)
    call = lambda a, b, s: bf16_gemm.scaled_bf16_gemm(a, b, s, out_dtype=jnp.bfloat16)
  if across_devices:  # each device's rows of A, its own GEMM
    mesh = Mesh(np.array(eight_devices), ("d",))
    call = jax.shard_map(call, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P("d"))
  fn = jax.jit(call)
  scale = jnp.float32(1)
  text = fn.trace(a, b, scale).lower(lowering_platforms=("cuda",)).as_text()
  (line,) = [line for line in text.splitlines() if f"@jaxquant_{gemm}(" in line]
  if across_devices:
    rows = m // len(eight_devices)
    assert line.endswith(f"-> (tensor<{rows}x{n}xbf16>, tensor<777xui8>)"), line
    assert queries == [(f"jaxquant_{gemm}", (rows, n))]
  else:
    assert line.endswith(f"-> tensor<{m}x{n}xbf16>"), line
    assert queries == []
  assert jax.eval_shape(fn, a, b, scale).shape == (m, n)
