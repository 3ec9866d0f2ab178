"""Reference models whose parameters pytreeio formats store.

Each submodule imports its deep-learning dependencies (jax, flax) itself, so
importing this package costs nothing; import the submodule you need, e.g.
``from pytreeio.models import tinyllama``.
"""
