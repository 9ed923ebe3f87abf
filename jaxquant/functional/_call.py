"""One call of a quantized function: its params, the state it reads and writes, its key,
and the `Host` through which the interception asks for them (`FunctionHost`).

A call runs in one of three modes:

- "call" (`qfn(*args)`): no state and no key. A delayed-scaling GEMM is refused (its
  state has nowhere to go); a GEMM that rounds stochastically only in its backward runs
  its forward without a key, and its gradient asks for one.
- "init" (`qfn.init(*args)`, traced abstractly): every delayed-scaling GEMM met records
  what state it needs (`StateSpec`), which `init` then makes; the GEMMs run on fresh
  states that the trace throws away.
- "apply" (`qfn.apply(*args, state=, rng=)`): each delayed-scaling GEMM reads its
  weight's states and writes the states it recorded; the call hands them back.

The state is `{role name: {tensor_type: RoleState}}`, a role named by its weight's path
(`_paths`). A weight scanned over by `lax.scan` (`_scan`) has states stacked along the
scan's length, one per layer, as `nn.scan` stacks a Linen layer's.

Keys: each GEMM that rounds stochastically derives its key from the call's `rng` by
folding in its name (`what`: the call and the weight's role) and how many times that
name drew before in this call (and, in a scan's body, the iteration: `_scan`).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Literal, Optional

import jax

from jaxquant.intercept._hosts import WritesBack
from jaxquant.intercept._keys import draws_key
from jaxquant.intercept._role_state import (
  init_grouped_role_states,
  init_role_states,
  is_role_state,
  stacked_role_states,
)
from jaxquant.quantizers import needs_state

Mode = Literal["call", "init", "apply"]


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """The states one weight's GEMM needs: its roles and quantizers, its groups (a grouped
  GEMM's, or None) and the lengths of the scans stacking it (outermost first)."""

  roles: dict
  quantizers: dict
  num_groups: Optional[int]
  stacked: tuple[int, ...]

  def fresh(self) -> dict:
    if self.num_groups is None:
      states = init_role_states(self.roles, self.quantizers)
    else:
      states = init_grouped_role_states(self.roles, self.quantizers, self.num_groups)
    return stacked_role_states(states, self.stacked) if self.stacked else states


@dataclasses.dataclass
class CallState:
  """What one call (or one scan body of it) keeps while its function is traced."""

  mode: Mode
  params: dict[str, Any]  # {role name: the value the function's code reads}
  states: dict[str, dict]  # {role name: {tensor_type: RoleState}}
  key: Optional[jax.Array]
  specs: dict[str, StateSpec]  # "init": what each stateful weight needs (shared by scans)
  stacked: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  draws: dict[str, int] = dataclasses.field(default_factory=dict)

  def next_key(self, name: str) -> Optional[jax.Array]:
    """The key of the `name`d draw: the call's key folded with `name` and its count."""
    if self.key is None:
      return None
    count = self.draws.get(name, 0)
    self.draws[name] = count + 1
    key = jax.random.fold_in(self.key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return jax.random.fold_in(key, count)


@dataclasses.dataclass(frozen=True)
class FunctionHost(WritesBack):
  """The `Host` of a function's weights: their state and keys are the call's."""

  call: CallState

  def key(self, quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    if not draws_key(quantizers):
      return None
    if self.call.mode == "init":
      return jax.random.key(0)  # init traces shapes only
    if self.call.key is None:
      if optional:
        return None
      raise ValueError(
        f"{what}: its recipe rounds stochastically; pass a PRNG key: "
        "qfn.apply(*args, state=state, rng=key)"
      )
    return self.call.next_key(what)

  def state(self, param: str, roles, quantizers, what: str, num_groups=None) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    if self.call.mode == "call":
      raise ValueError(
        f"{what}: its recipe uses delayed scaling, whose state a plain call keeps nowhere. "
        "Make the state with state = qfn.init(*args) and call "
        "out, state = qfn.apply(*args, state=state)"
      )
    if self.call.mode == "init":
      spec = StateSpec(roles, stateful, num_groups, self.call.stacked.get(param, ()))
      self.call.specs[param] = spec
      unstacked = dataclasses.replace(spec, stacked=())
      return {t: s.scaling for t, s in unstacked.fresh().items()}
    return self._held(param, stateful, what, num_groups)

  def _held(self, param: str, stateful: dict, what: str, num_groups) -> dict:
    held = self.call.states.get(param)
    if held is None:
      raise ValueError(
        f"{what}: the state holds none for role {param!r}; make it with qfn.init(*args) "
        "under the same recipe (and params of the same structure)"
      )
    for t, state in held.items():
      if not is_role_state(state):
        raise TypeError(
          f"{what}: state[{param!r}][{t!r}] holds a {type(state).__name__}, not a "
          "jaxquant RoleState: a checkpoint restored without a target gives plain dicts. "
          "Restore it with the state of qfn.init as the target"
        )
    want = () if num_groups is None else (num_groups,)
    found = {t: (s.quantizer, s.scaling.scale.shape) for t, s in held.items()}
    if found != {t: (q, want) for t, q in stateful.items()}:
      raise ValueError(
        f"{what}: state[{param!r}] holds states for {found}, but the recipe gives "
        f"{ {t: (q, want) for t, q in stateful.items()} }; make the state with qfn.init "
        "under this recipe"
      )
    return {t: s.scaling for t, s in held.items()}

  def write_state(self, param: str, new_state: dict) -> None:
    if self.call.mode != "apply":
      return  # init's states are made afresh from its specs
    held = self.call.states[param]
    self.call.states[param] = {
      t: dataclasses.replace(s, scaling=new_state.get(t, s.scaling)) for t, s in held.items()
    }
