"""optax transformations that reproduce the original systems' own update rules.

A checkpoint from DataCode, cl-waffe2 or bullet resumes in JAX under the rule
that system trains with (which differs from stock optax in grouping, bias
correction or clipping), so that training continues as it would have there.
Each module imports jax/optax only when a transformation is built.
"""
