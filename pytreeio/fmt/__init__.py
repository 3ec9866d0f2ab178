"""The built-in formats, one module each; each registers its :class:`pytreeio.Format` on import.

:func:`load` imports them; :mod:`pytreeio.registry` calls it the first time the
registry is consulted, so ``import pytreeio`` stays cheap and the registry
itself names no format.
"""

from __future__ import annotations

import importlib

__all__ = ["BUILTIN", "load"]

#: The modules under ``pytreeio.fmt`` that register the built-in formats.
BUILTIN: tuple[str, ...] = (
    "safetensors",
    "tinyllama",
    "netcl",
    "netcl_checkpoint",
    "datacode",
    "waffe2",
    "bullet",
    "msgpack",
)


def load() -> None:
    """Import (and so register) every built-in format module."""
    for module in BUILTIN:
        importlib.import_module(f"{__name__}.{module}")
