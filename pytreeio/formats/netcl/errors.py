"""The errors of netcl checkpoints that netcl itself raises as ``KeyError``/``ValueError``."""

from pytreeio.core.errors import MismatchError

__all__ = ["NetclMissingParamError", "NetclShapeMismatchError"]


class NetclMissingParamError(MismatchError, KeyError):
    """A parameter name is absent from a netcl checkpoint (netcl itself raises ``KeyError``)."""

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return MismatchError.__str__(self)


class NetclShapeMismatchError(MismatchError):
    """A netcl checkpoint array's shape differs from the parameter's (netcl: ``ValueError``)."""
