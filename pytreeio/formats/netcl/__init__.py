"""netcl: the ``.netcl`` model file and legacy pair (:mod:`.model_file`), the training checkpoint
and raw parameters (:mod:`.checkpoint`), and the naming they share (:mod:`.naming`)."""

from pytreeio.formats.netcl.errors import NetclMissingParamError, NetclShapeMismatchError

__all__ = ["NetclMissingParamError", "NetclShapeMismatchError"]
