"""The interception core: quantize the GEMMs a program makes, whoever wrote it.

While a routing is open (`_interception`), the contractions a program calls
(`lax.dot_general`, `jnp.einsum`, `jnp.dot`, `jnp.matmul`, `@`, the ragged dots: the
data of `_targets`) go to a handler (`_routed.handle`), which reads each one as a
two-operand contraction (`_calls`), asks the running `Session` (`_session`) which operand
is a param (`_provenance` walks a traced operand back to one), and runs a contraction
with one weight operand as a GEMM (`_contraction`: one `ops.dense` or `ops.grouped_dense`
call) under the recipe, the weight's `Host` (`_hosts`) keeping its delayed-scaling state
(`_role_state`) and drawing its key (`_keys`). `_found_gemms` refuses a recipe that met
no weight GEMM, `_report` is the swap report's table.

It knows no framework: the integrations above it supply the session's params and the
hosts, the Flax swap-in (`jaxquant.flax.swap`) from modules, `jaxquant.functional` from
a function's parameter argument. Its modules are private; their public names are those
integrations'.
"""
