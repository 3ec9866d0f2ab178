"""The error types of pytreeio.

Every failure that comes from the content of a file (or buffer) is a
`FormatError`; every disagreement between a file and what the caller
asked for (``like=``, ``meta=``) is a `MismatchError`.  Both derive from
``ValueError`` so that generic callers that catch ``ValueError`` keep working.
``FileNotFoundError`` and other ``OSError``\\ s are left as the builtins.
Every error pickles with its fields (``BaseException``'s pickling keeps the
instance ``__dict__``), so errors cross process pools intact.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PytreeioError",
    "PytreeioWarning",
    "FormatError",
    "MismatchError",
    "QuantisationError",
    "UnknownFormatError",
    "EncodeError",
    "ConversionError",
]


class PytreeioError(Exception):
    """Base class of every error raised by pytreeio."""


class PytreeioWarning(UserWarning):
    """Something was dropped or only partly saved (the message says what)."""


class FormatError(PytreeioError, ValueError):
    """A file or buffer is malformed, truncated or not of the expected format.

    Attributes:
      path: the file the bytes came from (``None`` for an in-memory buffer
        until the I/O layer fills it in).
      offset: byte offset in that file where the problem was found, if any.
      field: the name of the field or record being read, e.g. ``"header.version"``
        or ``"layer 1 Wq"``.
      reason: the bare message, without location.
    """

    def __init__(
        self,
        reason: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.path = path
        self.offset = offset
        self.field = field
        super().__init__(reason)

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(str(self.path))
        if self.field is not None:
            where.append(f"field {self.field!r}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason


class MismatchError(PytreeioError, ValueError):
    """A file's content and the caller's ``like`` tree or ``meta`` disagree.

    Attributes:
      key_path: canonical key string (or entry name) where they disagree.
      expected: what the caller's template asked for.
      found: what the file holds.
      path: the file, when known.
    """

    def __init__(
        self,
        reason: str,
        *,
        key_path: str | None = None,
        expected: Any = None,
        found: Any = None,
        path: str | None = None,
    ) -> None:
        self.reason = reason
        self.key_path = key_path
        self.expected = expected
        self.found = found
        self.path = path
        super().__init__(reason)

    def __str__(self) -> str:
        parts = []
        if self.path is not None:
            parts.append(str(self.path))
        if self.key_path is not None:
            parts.append(f"at {self.key_path!r}")
        head = ", ".join(parts)
        msg = f"{head}: {self.reason}" if head else self.reason
        if self.expected is not None or self.found is not None:
            msg += f" (expected {self.expected}, found {self.found})"
        return msg


class QuantisationError(PytreeioError, OverflowError):
    """A value does not fit the integer type it is quantised to (or is NaN/inf).

    Attributes:
      tensor: the tensor's id or name.
      index: the flat (C-order) index of the first element that does not fit.
      position: that element's multi-dimensional index.
      value: its value.
    """

    def __init__(
        self,
        reason: str,
        *,
        tensor: str | None = None,
        index: int | None = None,
        position: tuple[int, ...] | None = None,
        value: float | None = None,
    ) -> None:
        self.reason = reason
        self.tensor = tensor
        self.index = index
        self.position = position
        self.value = value
        super().__init__(reason)


class UnknownFormatError(PytreeioError, ValueError):
    """No registered format matches the name, suffix or content given.

    Attributes:
      path: the file or directory whose format could not be told (None for a bare name).
    """

    def __init__(self, reason: str, *, path: str | None = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(reason)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path is not None else self.reason


class ConversionError(PytreeioError, ValueError):
    """A conversion whose target cannot hold the source's information.

    Raised before anything is written; ``what`` lists what does not fit
    (layer names, optimizer kinds, entries).
    """

    def __init__(self, reason: str, *, what: list[str] | None = None) -> None:
        self.reason = reason
        self.what = list(what or [])
        super().__init__(reason)


class EncodeError(PytreeioError, TypeError):
    """A tree cannot be written in the requested format (unsupported leaf, key or dtype).

    Raised by ``encode``/``save`` before anything is written; ``key_path``
    names the offending entry.
    """

    def __init__(self, reason: str, *, key_path: str | None = None) -> None:
        self.reason = reason
        self.key_path = key_path
        super().__init__(reason)

    def __str__(self) -> str:
        return f"at {self.key_path!r}: {self.reason}" if self.key_path is not None else self.reason
