"""netcl: the ``.netcl`` model file and legacy pair (`.model_file`), the training checkpoint
and raw parameters (`.checkpoint`), and the naming they share (`.naming`)."""

from pytreeio.formats.netcl.errors import NetclMissingParamError, NetclShapeMismatchError

__all__ = ["NetclMissingParamError", "NetclShapeMismatchError"]
