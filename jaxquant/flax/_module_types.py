"""The module types of the roles Flax layers name (`roles.QuantizerRole.module_type`):
the recipe maps a (module type, name) to its quantizers."""

LINEAR = "linear"  # a dense GEMM: Dense, DenseGeneral, Einsum, Linear, a routed contraction
