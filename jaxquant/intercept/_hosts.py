"""Where a routed weight GEMM keeps its delayed-scaling state and draws its key: the `Host`
protocol, which the handler of routed contractions (`_routed`) alone asks, and `WeightRef`,
the param a contraction met, named by its owner's path.

Each integration supplies its hosts: the Flax swap-in a Linen module, an NNX module or a
hook (`jaxquant.flax.swap`); a quantized function its explicit state and call key
(`jaxquant.functional`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol

import jax

from jaxquant.quantizers import Quantizer
from jaxquant.roles import QuantizerRole

Quantizers = dict[str, Optional[Quantizer]]
KERNEL = "kernel"  # the param name Flax's layers give their one weight
# `gemm(operands, state) -> (y, new_state)`: a weight GEMM of `operands` under its
# delayed-scaling `state` ({tensor_type: DelayedScalingState}, None: none), returning the
# state it recorded (None: none).
StatefulGemm = Callable[[tuple, Optional[dict]], tuple[jax.Array, Optional[dict]]]


class Host(Protocol):
  """What the handler asks of the owner of a weight operand; `what` names the GEMM in errors."""

  def key(self, quantizers: Quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    """The stochastic-rounding key of the GEMM (None when no quantizer rounds so). With no
    stream to draw from: None where `optional` (the GEMM's op asks for it where it rounds),
    else an error saying how to give one."""

  def state(
    self,
    param: str,
    roles: dict[str, QuantizerRole],
    quantizers: Quantizers,
    what: str,
    num_groups: Optional[int] = None,
  ) -> Optional[dict]:
    """{tensor_type: DelayedScalingState} for the delayed-scaling quantizers, else None;
    one per group (a leading [num_groups] axis) for a grouped GEMM."""

  def write_state(self, param: str, new_state: dict) -> None:
    """Stores the state the GEMM returned (called only when `state` gave one)."""

  def run(self, param: str, gemm: StatefulGemm, operands: tuple, state: Optional[dict]):
    """The output of `gemm(operands, state)` (`state` as this host's `state` gave it);
    the state it returns kept as the host keeps it."""


class WritesBack:
  """`Host.run` of a host that stores the state the GEMM returned (`write_state`)."""

  def run(self, param: str, gemm: StatefulGemm, operands: tuple, state: Optional[dict]):
    y, new_state = gemm(operands, state)
    if new_state is not None:
      self.write_state(param, new_state)
    return y


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """A param the model's code contracted: its owner's path, its name and the owner's host."""

  path: str
  param: str
  host: Host

  @property
  def role_name(self) -> str:
    """The owner's path for a `kernel` (Flax's name for a layer's one weight, as the stock
    layers' roles are named), else the param's full path; the root module's weights by
    their own name. The rule reads this param alone, so a role keeps its name when the
    owner gains or loses sibling params (a policy written for it keeps matching)."""
    if not self.path:
      return self.param
    return self.path if self.param == KERNEL else f"{self.path}/{self.param}"
