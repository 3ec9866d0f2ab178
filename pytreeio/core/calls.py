"""The public functions' calling convention, and the error that explains it.

The path (and the tree, for saves) is positional; everything else is keyword-only.
Python's own error for ``ptio.load(path, "msgpack")`` says only "takes 1 positional
argument but 2 were given"; `keywords_explained` says which keyword was meant.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["keywords_explained", "check_like"]

F = TypeVar("F", bound=Callable[..., Any])


def keywords_explained(func: F) -> F:
    """``func`` with a ``TypeError`` naming the keyword for a stray positional argument."""
    params = inspect.signature(func).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(positional):
            raise TypeError(_advice(func.__name__, positional, keywords, args[len(positional)]))
        return func(*args, **kwargs)

    return call  # type: ignore[return-value]


def _advice(name: str, positional: list[str], keywords: list[str], stray: Any) -> str:
    subjects = [p for p in positional if p != "self"]
    if subjects:
        head = (
            f"{name}() takes {' and '.join(subjects)} positionally and everything else by keyword"
        )
    else:
        head = f"{name}() takes its arguments by keyword"
    if isinstance(stray, str):
        if "format" in keywords:
            return f"{head}: a format goes by keyword, pass format={stray!r}"
        if "to" in keywords:
            return f"{head}: a format goes by keyword, pass to={stray!r} (from_= for the source's)"
    if "like" in keywords:
        return f"{head}: pass the tree to restore into as like=..."
    return f"{head} ({', '.join(k + '=' for k in keywords)})"


def check_like(like: Any) -> None:
    """Refuse a string ``like``: no one means a tree by it (a format name goes to ``format=``)."""
    if isinstance(like, str | bytes):
        raise TypeError(
            f"like= takes the tree to restore into, not the string {like!r} "
            f"(a format name goes to format=)"
        )
