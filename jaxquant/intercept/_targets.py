"""The entry points a program calls to contract two arrays, as data: what the interception
(`_interception`) takes over while a routing is open, each routed as a `Call` of its kind;
and the transformations that hand a function its params as arguments (`lax.scan`,
`jax.checkpoint`), taken over only for an integration that asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ContractionTarget:
  """`owner.attribute`, routed as a `Call` of `kind`. `operator`: None for a function,
  "left" for `a @ b` (`__matmul__`), "right" for its reflection (`__rmatmul__`), whose
  call then holds the operands in mathematical order."""

  owner: Any
  attribute: str
  kind: str
  operator: Optional[str] = None


@functools.cache
def contraction_targets() -> tuple[ContractionTarget, ...]:
  """The same targets for every thread and trace. `@` is taken over on `jax.core.Tracer`
  (every tracer class inherits its operators) and on the concrete array class, which
  owns operators of its own. `ragged_dot` is `ragged_dot_general` with the plain
  dimension numbers (`[M, K]` rows in groups, `[G, K, N]`); JAX's `ragged_dot` calls
  `ragged_dot_general` from its own module, which is not routed again."""
  # The concrete class is found by building an array, so on first use rather than at
  # import (which would start JAX's backend), and at compile time: inside a trace
  # `jnp.zeros` gives a tracer.
  with jax.ensure_compile_time_eval():
    array_class = type(jnp.zeros(()))
  return (
    ContractionTarget(jax.lax, "dot_general", "dot_general"),
    ContractionTarget(jax.lax, "ragged_dot", "ragged_dot"),
    ContractionTarget(jax.lax, "ragged_dot_general", "ragged_dot_general"),
    ContractionTarget(jnp, "einsum", "einsum"),
    ContractionTarget(jnp, "dot", "dot"),
    ContractionTarget(jnp, "matmul", "matmul"),
    *(
      ContractionTarget(cls, attribute, "matmul", operator)
      for cls in (jax.core.Tracer, array_class)
      for attribute, operator in (("__matmul__", "left"), ("__rmatmul__", "right"))
    ),
  )


@functools.cache
def transform_targets() -> tuple[ContractionTarget, ...]:
  """The transformations that trace a function of their own with the params as its
  arguments, where a walk back from an operand cannot reach them, and out of which what
  an integration writes while tracing (a delayed-scaling state) must be returned: `lax.scan`
  (kind "scan": a loop over stacked params, a model's layers) and `jax.checkpoint` /
  `jax.remat` (kind "checkpoint"). Routed where an integration asks for them."""
  return (
    ContractionTarget(jax.lax, "scan", "scan"),
    ContractionTarget(jax, "checkpoint", "checkpoint"),
    ContractionTarget(jax, "remat", "checkpoint"),
  )
