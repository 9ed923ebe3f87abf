"""Readings of compiled HLO text that tests in several folders share."""

import re

_COMPUTATION = re.compile(r"^%?([\w.\-]+) \(.*\) -> .* \{$")
_ALL_REDUCE = re.compile(r"all-reduce(?:-start)?\((.*?)\), .*to_apply=%?([\w.\-]+)")


def max_reduced_values(hlo: str) -> set[str]:
  """The distinct values that the all-reduces of compiled HLO reduce with a maximum: the
  amaxes (jaxquant takes an amax as the u32 maximum of the magnitudes' bits, XLA's own
  partitioned max-reductions alike). Counted by operand, not by instruction, since XLA
  combines several all-reduces into one."""
  maximum_computations, name = set(), None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(1)
    elif name and line.strip().startswith("ROOT") and " maximum(" in line:
      maximum_computations.add(name)
  values = set()
  for operands, reducer in _ALL_REDUCE.findall(hlo):
    if reducer in maximum_computations:
      values |= {o.strip().lstrip("%") for o in operands.split(",")}
  return values
