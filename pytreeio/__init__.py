"""pytreeio: read and write neural-network checkpoints as plain JAX pytrees.

>>> import pytreeio as ptio
>>> ptio.save("ckpt.msgpack", {"params": params, "opt_state": opt_state})
>>> state = ptio.load("ckpt.msgpack", like={"params": params, "opt_state": opt_state})

The path (and the tree, for saves) is positional; everything else is keyword-only.
``import pytreeio`` imports numpy only; jax, flax and optax are
imported by the operations that need them.
"""

from pytreeio.api import (
    convert,
    convert_encoded,
    decode,
    decode_with_meta,
    encode,
    inspect,
    inspect_encoded,
    list_formats,
    load,
    load_with_meta,
    save,
    verify,
)
from pytreeio.async_save import SaveFuture, save_async, wait_saves
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
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
from pytreeio.io import ChangedWhileOpen
from pytreeio.lazy import Checkpoint, open

__version__ = "0.1.0"

__all__ = [
    # files
    "save",
    "save_async",
    "wait_saves",
    "SaveFuture",
    "load",
    "load_with_meta",
    "open",
    "Checkpoint",
    "inspect",
    "verify",
    "convert",
    # the same in memory
    "encode",
    "decode",
    "decode_with_meta",
    "inspect_encoded",
    "convert_encoded",
    # formats
    "list_formats",
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
    # trees
    "flatten",
    "unflatten",
    # errors
    "PytreeioError",
    "FormatError",
    "MismatchError",
    "QuantisationError",
    "UnknownFormatError",
    "EncodeError",
    "ConversionError",
    "ChangedWhileOpen",
    "PytreeioWarning",
    "__version__",
]
