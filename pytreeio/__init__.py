"""pytreeio: read and write neural-network checkpoints as plain JAX pytrees.

>>> import pytreeio as ptio
>>> ptio.save("ckpt.msgpack", {"params": params, "opt_state": opt_state})
>>> state = ptio.load("ckpt.msgpack", like={"params": params, "opt_state": opt_state})

``import pytreeio`` imports numpy and msgpack only; jax, flax and optax are
imported by the operations that need them.
"""

from pytreeio.api import (
    convert,
    convert_buffer,
    decode,
    encode,
    formats,
    inspect,
    inspect_buffer,
    load,
    load_with_meta,
    save,
    verify,
)
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    NetclMissingParamError,
    NetclShapeMismatchError,
    PytreeioError,
    PytreeioWarning,
    QuantisationError,
    UnknownFormatError,
)
from pytreeio.core.records import (
    DIRECTORY,
    FILE,
    Decoded,
    Encoded,
    Entry,
    Format,
    Info,
    Probe,
    Siblings,
)
from pytreeio.core.tree import flatten, unflatten
from pytreeio.formats.registry import register

__version__ = "0.1.0"

__all__ = [
    "save",
    "save_async",
    "wait_saves",
    "SaveFuture",
    "load",
    "load_with_meta",
    "open",
    "Checkpoint",
    "inspect",
    "inspect_buffer",
    "convert",
    "convert_buffer",
    "encode",
    "decode",
    "verify",
    "formats",
    "flatten",
    "unflatten",
    "register",
    "Format",
    "Encoded",
    "Decoded",
    "Info",
    "Entry",
    "Probe",
    "FILE",
    "DIRECTORY",
    "Siblings",
    "PytreeioError",
    "FormatError",
    "MismatchError",
    "QuantisationError",
    "UnknownFormatError",
    "EncodeError",
    "ConversionError",
    "PytreeioWarning",
    "NetclMissingParamError",
    "NetclShapeMismatchError",
    "__version__",
]

# save_async and friends, and the lazy views, load their modules on first use.
_ASYNC = frozenset({"save_async", "wait_saves", "SaveFuture"})
_LAZY = frozenset({"open", "Checkpoint"})


def __getattr__(name: str) -> object:
    if name in _ASYNC:
        from pytreeio import async_save

        return getattr(async_save, name)
    if name in _LAZY:
        from pytreeio import lazy

        return getattr(lazy, name)
    raise AttributeError(f"module 'pytreeio' has no attribute {name!r}")
