"""The handler of routed contractions: a contraction with one weight operand, as a GEMM
per the recipe.

For each routed call (`_calls.Call`) made while a `jaxquant.intercept._session.Session` is
active:

1. it is written as a two-operand contraction (`_calls.contraction`); anything else runs
   as written, listed as not a weight GEMM;
2. each operand is looked up among the model's params (`Session.find_weight`); with no
   param operand (attention scores, probabilities times values) or two, it runs as
   written, listed as not a weight GEMM;
3. the weight's role is named by its owner module's path (plus the param's name unless it
   is `kernel`, so that siblings never rename it); the recipe gives its quantizers
   ("linear" roles, or "grouped_linear" when axes are shared by both operands and the
   output: per-expert weights, one GEMM per expert through `ops.grouped_dense`);
4. a contraction the recipe maps to None runs as written (bit-identical), and so does
   a tiny one (K or N below one block: `_contraction.tiny_reason`) where the recipe keeps
   those in high precision (the presets do); one whose shape a quantizer does not fit
   raises (`_contraction.unfit_error`), or with `on_unfit="high_precision"` runs as
   written; every other one runs through `ops.dense` / `ops.grouped_dense` in the dtype
   the call would have produced; a delayed-scaling GEMM with the state its weight's host
   keeps (`_hosts`: one per weight GEMM, one per expert for a grouped one).

A ragged dot (`lax.ragged_dot`: rows in groups, one `[K, N]` of its `[G, K, N]` rhs per
group) whose rhs is a param is a "grouped_linear" role, run by `ops.grouped_dense` on
the call's own rows and group sizes; a param lhs alone is no weight GEMM.
"""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
import numpy as np

from jaxquant import ops, recipes
from jaxquant.intercept import _calls as calls
from jaxquant.intercept import _contraction as contraction
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._calls import Call
from jaxquant.intercept._keys import without_key
from jaxquant.ops._operands import is_high_precision
from jaxquant.roles import GROUPED_LINEAR, LINEAR, gemm_roles


def _row(path, call, found, shapes, role=None, quantizers=None, status=sessions.NOT_A_WEIGHT_GEMM):
  return sessions.Row(path, calls.describe(call, found), shapes, role, quantizers, status)


def _no_weight_status(session, found) -> str:
  """Not a weight GEMM; and why an operand looks like a weight all the same, if one does."""
  why = next(filter(None, map(session.why_unmatched, (found.lhs, found.rhs))), None)
  return sessions.NOT_A_WEIGHT_GEMM if why is None else sessions.unresolved_status(why)


def handle(call: Call):
  """Runs one routed call under the current session (see the module docstring)."""
  session = sessions.current()
  if session is None:
    return call.fallback()
  found = calls.contraction(call)
  if isinstance(found, str):
    shapes = tuple(np.shape(a) for a in call.args if hasattr(a, "shape"))
    session.record(_row("", call, None, shapes, status=f"{sessions.NOT_A_WEIGHT_GEMM} ({found})"))
    with sessions.param_contraction_scope():  # met, and listed with its reason
      return call.fallback()
  if isinstance(found, calls.RaggedContraction):
    return _ragged(session, call, found)
  shapes = (np.shape(found.lhs), np.shape(found.rhs))
  refs = (session.find_weight(found.lhs), session.find_weight(found.rhs))
  if refs == (None, None):
    session.record(_row("", call, found, shapes, status=_no_weight_status(session, found)))
    return call.fallback()
  # A contraction of a param, met here: `swap_report` looks for those nothing met.
  with sessions.param_contraction_scope():
    return _param_contraction(session, call, found, shapes, refs)


def handle_scan(call: Call):
  """Runs one routed `lax.scan` as the current session's integration runs it
  (`Session.scan`), else as written, its body's contractions routed."""
  session = sessions.current()
  if session is None or session.scan is None:
    with routing_pause.paused(False):
      return call.fallback()
  return session.scan(call)


def checkpointed(call: Call):
  """A routed `jax.checkpoint(fun, **options)`: the checkpointed function, which runs as
  the session current when it is called runs it (`Session.checkpoint`), else as written."""
  bound = inspect.signature(call.original).bind(*call.args, **call.kwargs)
  options = dict(bound.arguments)
  fun = options.pop("fun")

  @functools.wraps(fun)
  def run(*args, **kwargs):
    session = sessions.current()
    if session is None or session.checkpoint is None:
      return call.original(fun, **options)(*args, **kwargs)
    return session.checkpoint(call.original, fun, options, args, kwargs)

  return run


def _param_contraction(session, call: Call, found: calls.Contraction, shapes, refs):
  """A contraction with a param operand (`refs`: the operands' weight references)."""
  if None not in refs:
    why = " (both operands are params)"
    session.record(_row(refs[0].path, call, found, shapes, status=sessions.NOT_A_WEIGHT_GEMM + why))
    return call.fallback()
  if contraction.contracts_no_axis(found.lhs_letters, found.rhs_letters, found.out_letters):
    why = " (it contracts no axis: an elementwise or outer product)"
    path = (refs[0] or refs[1]).path
    session.record(_row(path, call, found, shapes, status=sessions.NOT_A_WEIGHT_GEMM + why))
    return call.fallback()
  weight_first = refs[0] is not None
  ref = refs[0] or refs[1]
  x, w = (found.rhs, found.lhs) if weight_first else (found.lhs, found.rhs)
  x_l, w_l = (
    (found.rhs_letters, found.lhs_letters)
    if weight_first
    else (found.lhs_letters, found.rhs_letters)
  )
  shapes = (np.shape(x), np.shape(w))
  what = f"{calls.describe(call, found)} with weight {ref.role_name!r}"
  not_gemm = contraction.not_a_gemm(x_l, w_l, found.out_letters)
  plan = None if not_gemm else contraction.plan_contraction(x_l, w_l, found.out_letters)
  grouped = isinstance(plan, contraction.GroupedPlan)
  module_type = GROUPED_LINEAR if grouped else LINEAR

  m, k, n = (0, 0, 0) if plan is None else plan.dims(np.shape(x), np.shape(w))

  def unfit(recipe, quantizers):
    if plan is None:
      return not_gemm
    if grouped or session.on_unfit == "high_precision":
      # ops.grouped_dense checks the weight's backward usages even for a forward only.
      return contraction.unfit_reason(
        0 if grouped else m, k, n, quantizers, backward=recipe.backward
      )
    # Raising: the forward's dims, and K and N of the backward's (the weight's own); M of
    # the backward is checked when a gradient is traced, so few-token inference runs.
    return contraction.unfit_reason(m, k, n, quantizers) or contraction.unfit_reason(
      0, k, n, quantizers, backward=recipe.backward
    )

  weight_dims = None if plan is None else (k, n)
  admitted = _admit(session, call, found, shapes, ref, module_type, what, unfit, weight_dims)
  if admitted is None:
    return call.fallback()
  recipe, quantizers = admitted
  dtype = found.preferred_element_type or jnp.result_type(found.lhs, found.rhs)
  operand = x
  x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  # None without a stream: a forward alone may need none (ops.dense asks where it rounds;
  # a grouped GEMM, `_grouped.without_key`).
  key = ref.host.key(quantizers, what, optional=True)
  if grouped:
    _check_shard_scaling(session, what)
    return _grouped(plan, x, w, quantizers, recipe, ref, key, what)
  roles = gemm_roles(module_type, ref.role_name)
  state = ref.host.state(ref.param, roles, quantizers, what)

  def gemm(operands, state):
    x, w = operands
    return contraction.quantized_gemm(
      plan,
      x,
      w,
      quantizers=quantizers,
      backward=recipe.backward,
      name=ref.role_name,
      what=what,
      key=key,
      state=state,
      fast_accumulation=recipe.fast_accumulation,
      shard_scaling=session.shard_scaling,
      layer_input=operand,
    )

  return ref.host.run(ref.param, gemm, (x, w), state)


def _grouped(plan, x, w, quantizers, recipe, ref, key, what):
  def grouped_gemm(x2d, k3d, group_sizes):
    return _grouped_dense(x2d, k3d, group_sizes, quantizers, recipe, ref, key, what), None

  return plan.run(x, w, grouped_gemm)[0]


def _admit(session, call, found, shapes, ref, module_type, what, unfit_reason, weight_dims):
  """(recipe, quantizers) of a routed weight GEMM, its row recorded as quantized; None,
  its row recorded with the reason, where it runs as written: the recipe maps its role to
  high precision, or keeps it there as a tiny GEMM (`weight_dims`: its (K, N), None for
  no GEMM), or `unfit_reason(recipe, quantizers)` names why its shape does not fit
  (which raises under `on_unfit="error"`)."""
  recipe = recipes.resolve(session.recipe)
  quantizers = recipe.quantizers(module_type, ref.role_name)
  row = lambda status: _row(ref.path, call, found, shapes, ref.role_name, quantizers, status)
  if is_high_precision(quantizers):
    session.record(row(sessions.RECIPE_NONE))
    return None
  tiny = weight_dims and contraction.tiny_status(*weight_dims, quantizers, recipe)
  if tiny:
    session.record(row(tiny))
    return None
  reason = unfit_reason(recipe, quantizers)
  if reason:
    _unfit(session, what, reason, ref, row)
    return None
  _check_weight_gather(session, quantizers, what, ref)
  session.record(row(sessions.QUANTIZED))
  return recipe, quantizers


def _check_weight_gather(session, quantizers, what, ref):
  if session.weight_gather is not None and quantizers["weight"] is not None:
    raise ValueError(
      f"{what}: quantize_model's weight_gather gathers the kernels of Dense, "
      "DenseGeneral and Einsum layers; a weight the model's own code contracts "
      "would be gathered in high precision. Map role "
      f"{ref.role_name!r} to None in the recipe, or leave weight_gather out"
    )


def _check_shard_scaling(session, what):
  if session.shard_scaling is not None:
    raise ValueError(
      f"{what}: quantize_model's shard_scaling scales the rows of dense contractions "
      "per shard; a grouped (MoE) contraction's rows are its experts' tokens, which it "
      "does not take. Map this role to None in the recipe, or leave shard_scaling out"
    )


def _unfit(session, what, reason, ref, row):
  """Raises for `on_unfit="error"`; records the row of a call run as written otherwise."""
  if session.on_unfit == "error":
    raise contraction.unfit_error(what, reason, ref.role_name)
  session.record(row(sessions.unfit_status(reason)))


def _ragged(session, call: Call, found: calls.RaggedContraction):
  """A ragged dot with a param rhs through `ops.grouped_dense`, per the recipe."""
  shapes = (np.shape(found.lhs), np.shape(found.rhs))
  lhs_ref, ref = session.find_weight(found.lhs), session.find_weight(found.rhs)
  if lhs_ref is None and ref is None:
    session.record(_row("", call, found, shapes, status=_no_weight_status(session, found)))
    return call.fallback()
  with sessions.param_contraction_scope():  # a contraction of a param, met here
    return _ragged_param(session, call, found, shapes, lhs_ref, ref)


def _ragged_param(session, call, found, shapes, lhs_ref, ref):
  """A ragged dot with a param operand (`lhs_ref`, `ref`: its lhs's and rhs's, or None)."""
  if lhs_ref is not None:
    why = (
      " (both operands are params)"
      if ref is not None
      else " (its lhs is a param, not its [G, K, N] rhs)"
    )
    session.record(_row(lhs_ref.path, call, found, shapes, status=sessions.NOT_A_WEIGHT_GEMM + why))
    return call.fallback()
  what = f"{calls.describe(call, found)} with weight {ref.role_name!r}"
  _, k, n = np.shape(found.rhs)

  def unfit(recipe, quantizers):
    # ops.grouped_dense checks the weight's backward usages even for a forward only.
    return contraction.unfit_reason(0, k, n, quantizers, backward=recipe.backward)

  admitted = _admit(session, call, found, shapes, ref, GROUPED_LINEAR, what, unfit, (k, n))
  if admitted is None:
    return call.fallback()
  recipe, quantizers = admitted
  dtype = found.preferred_element_type or jnp.result_type(found.lhs, found.rhs)
  x, w = jnp.asarray(found.lhs, dtype), jnp.asarray(found.rhs, dtype)
  key = ref.host.key(quantizers, what, optional=True)  # None: `_grouped.without_key`
  return _grouped_dense(x, w, found.group_sizes, quantizers, recipe, ref, key, what)


def _grouped_dense(x, w, group_sizes, quantizers, recipe, ref, key, what):
  """`ops.grouped_dense` of a routed weight [G, K, N]; its delayed-scaling state, if its
  quantizers need one, holds one scale per group (its host's, made at the first call)."""
  roles = gemm_roles(GROUPED_LINEAR, ref.role_name)
  state = ref.host.state(ref.param, roles, quantizers, what, num_groups=np.shape(w)[0])

  def run(operands, key):
    x, w, group_sizes, state = operands
    out = ops.grouped_dense(
      x,
      w,
      group_sizes,
      quantizers=dict(quantizers),
      backward=recipe.backward,
      name=ref.role_name,
      key=key,
      state=state,
    )
    return (out, None) if state is None else out

  def gemm(operands, state):
    operands = (*operands, group_sizes, state)
    if key is None:
      return without_key(run, operands, quantizers, what)
    return run(operands, key)

  return ref.host.run(ref.param, gemm, (x, w), state)
