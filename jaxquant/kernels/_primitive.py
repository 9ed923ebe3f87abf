"""How every jaxquant kernel becomes a JAX primitive.

Each kernel is two primitives:

- the *inner* one is the kernel itself: its lowering is the FFI call on CUDA and the pure-JAX
  reference (the same function of the same inputs) on every other platform;
- the *outer* one is what users bind: it lowers to `custom_partitioning` around the inner
  one (so under a sharded `jit` each device runs the kernel on its shard, with the
  collectives the kernel's partitioning rule adds), and it has the batching rule
  (`custom_partitioning` has none).

Static options travel as one hashable `config` parameter, a frozen dataclass of the
kernel's own (`ffi_attributes()` encodes it as the FFI attributes its handler binds on CUDA).
The specs name the FFI targets, the one list of them (kernels/_targets.py registers them
with the library; tests/kernels/test_ffi_bindings.py checks them, and each config's
attributes, against the handlers ffi/ declares and binds).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

# Only for prim_requires_devices_during_lowering (see define) and for the axis context a
# lowering runs in (`_lowered_device_count`): JAX has no public way to ask for the device
# assignment while lowering a primitive.
from jax._src import dispatch, sharding_impls
from jax.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from jaxquant.kernels import _library as library


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What a kernel family supplies.

  abstract_eval(*avals, config) -> list of ShapedArray; reference(*arrays, config) -> list
  of arrays (the non-CUDA lowering); partition(config, mesh, arg_shapes, result_shape) ->
  (arg_specs, result_specs, local_fn) with local_fn(kernel, *shards) computing one
  shard's results, kernel(*arrays) the shard's kernel call; sharding_rule(config,
  arg_shapes, mesh_size) -> (einsum-like rule, kwargs), mesh_size the number of devices
  (a dim of blocks divisible by it shards evenly on any axes).
  """

  name: str  # the primitive's, and its FFI target's unless `ffi_targets` names several
  abstract_eval: Callable
  reference: Callable
  partition: Callable
  sharding_rule: Callable
  # (config, *avals) -> the dims the library's workspace query of the target takes, for a
  # kernel whose lowering adds a workspace result (`_library.workspace_bytes` sizes it).
  workspace_dims: Optional[Callable] = None
  # For a workspace that only speeds the kernel up beside other devices' collectives
  # (cuBLASLt's dynamically scheduled GEMMs): on one device the call goes without it. A
  # second result makes the call tuple-shaped, and XLA lets no fusion write its output in
  # place of a tuple's element: it cost the 8B train step 0.44-0.58 GiB of peak memory.
  workspace_only_across_devices: bool = False
  # A kernel of several FFI targets (the cast, one per family) lists them all and picks the
  # one of each call: config -> target.
  ffi_targets: tuple[str, ...] = ()
  pick_target: Optional[Callable] = None

  @property
  def targets(self) -> tuple[str, ...]:
    """Every FFI target the kernel may call."""
    return self.ffi_targets or (self.name,)

  def target(self, config) -> str:
    """The FFI target of one call."""
    return self.pick_target(config) if self.pick_target else self.name


def _lowered_device_count(ctx) -> Optional[int]:
  """The devices the computation being lowered runs on; None where JAX does not say (a
  kernel then keeps its workspace)."""
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.ShardingContext):
    return axis_context.num_devices
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):  # custom_partitioning, shard_map
    return axis_context.mesh.size
  return None


def _cuda_lowering(spec: KernelSpec):
  def lower(ctx, *args, config):
    error = library.register(spec.targets)
    if error:
      raise RuntimeError(f"{spec.name}: cannot lower to the CUDA kernel: {error}")
    ffi = jax.ffi.ffi_lowering(spec.target(config))
    if spec.workspace_dims is None or (
      spec.workspace_only_across_devices and _lowered_device_count(ctx) == 1
    ):
      return ffi(ctx, *args, **config.ffi_attributes())
    # The workspace is the call's last result, which nothing reads after it.
    target = spec.target(config)
    size = library.workspace_bytes(target, *spec.workspace_dims(config, *ctx.avals_in))
    with_workspace = ctx.replace(avals_out=[*ctx.avals_out, ShapedArray((size,), jnp.uint8)])
    return ffi(with_workspace, *args, **config.ffi_attributes())[:-1]

  return lower


def _batch_rule(outer: Primitive):
  """vmap: one kernel call per batch element (per-tensor amaxes stay per element)."""

  def rule(args, dims, *, config):
    # An unbatched argument has dim None (batching.not_mapped).
    size = next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)
    moved = [
      jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
      for a, d in zip(args, dims, strict=False)
    ]
    out = jax.lax.map(lambda xs: outer.bind(*xs, config=config), moved)
    return out, [0] * len(out)

  return rule


def define(spec: KernelSpec) -> Primitive:
  """Builds the inner and outer primitives of a kernel; returns the outer one."""
  inner = Primitive(spec.name + "_shard")
  inner.multiple_results = True
  inner.def_impl(functools.partial(xla.apply_primitive, inner))
  inner.def_abstract_eval(spec.abstract_eval)
  mlir.register_lowering(
    inner,
    mlir.lower_fun(lambda *a, config: spec.reference(*a, config=config), multiple_results=True),
  )
  mlir.register_lowering(inner, _cuda_lowering(spec), platform="cuda")

  def partition(config, mesh, arg_shapes, result_shape):
    arg_specs, result_specs, local_fn = spec.partition(config, mesh, arg_shapes, result_shape)
    named = lambda s: jax.sharding.NamedSharding(mesh, s)
    lower_fn = lambda *shards: local_fn(lambda *a: inner.bind(*a, config=config), *shards)
    # A tuple: custom_partitioning flattens the argument shardings against the operands'
    # tree, a tuple ("Expected tuple" from the fused-dequant GEMM's partition with a list).
    return (mesh, lower_fn, [named(s) for s in result_specs], tuple(named(s) for s in arg_specs))

  def sharding_rule(config, mesh, value_types, result_types):
    shapes = [tuple(t.shape) for t in value_types]
    return spec.sharding_rule(config, shapes, mesh.size)

  @functools.partial(custom_partitioning, static_argnums=(0,))
  def partitioned(config, *args):
    return inner.bind(*args, config=config)

  def infer_sharding_from_operands(config, mesh, arg_shapes, result_shape):
    # Only used without Shardy (GSPMD): the results take the shardings partition chooses.
    _, result_specs, _ = spec.partition(config, mesh, arg_shapes, result_shape)
    return [jax.sharding.NamedSharding(mesh, s) for s in result_specs]

  partitioned.def_partition(
    partition=partition,
    sharding_rule=sharding_rule,
    infer_sharding_from_operands=infer_sharding_from_operands,
  )

  outer = Primitive(spec.name)
  outer.multiple_results = True
  outer.def_impl(functools.partial(xla.apply_primitive, outer))
  outer.def_abstract_eval(spec.abstract_eval)
  lower_whole = mlir.lower_fun(
    lambda *a, config: inner.bind(*a, config=config), multiple_results=True
  )
  lower_partitioned = mlir.lower_fun(
    lambda *a, config: partitioned(config, *a), multiple_results=True
  )

  def lower_outer(ctx, *args, config):
    # One device (including eager calls, whose context names no devices): nothing to
    # partition, and custom_partitioning would refuse the missing device assignment.
    devices = getattr(ctx.module_context.axis_context, "device_assignment", ())
    if devices is None or len(devices) == 1:
      return lower_whole(ctx, *args, config=config)
    return lower_partitioned(ctx, *args, config=config)

  mlir.register_lowering(outer, lower_outer)
  # As for custom_partitioning itself: without this, jit lowers a jaxpr holding only the
  # outer primitive with no device assignment, lower_outer takes it for one device, and
  # XLA partitions the whole kernel (gathering its operands) instead of running `partition`.
  dispatch.prim_requires_devices_during_lowering.add(outer)
  batching.primitive_batchers[outer] = _batch_rule(outer)
  return outer
