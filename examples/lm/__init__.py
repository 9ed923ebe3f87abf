"""Pieces of the byte-level language-model example (examples/train_lm.py).

model.py     the plain Flax decoder-only transformer (the quantization seam is its nn.Dense layers)
data.py      the corpus: this interpreter's standard library sources as byte tokens
recipes.py   recipe names -> the model each one trains (plain, or jaxquant.flax.quantize_model)
presets.py   model and training sizes: tiny (CI), cpu, gpu
training.py  optimizer, train state, jitted train and eval steps (sharded with --mesh)
sharding.py  --mesh: the mesh, the logical axis rules, where each parameter goes
distributed.py  several processes of one job (jax.distributed): the flags, process 0's output
progress.py  a dependency-free text progress bar
report.py    the outputs: loss-curve PNG, markdown table, JSON of all curves
"""
