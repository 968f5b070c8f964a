"""Renamed keyword arguments: the old name keeps working for one release, with a
DeprecationWarning naming the new one; both names in one call are refused.

``@renamed_keywords("resurgo.save", incremental="as_base")`` on a function takes
``incremental=`` as ``as_base=``; on a class, its constructor does, and reading the old attribute
reads the new one. The signature, as ``inspect`` and the documentation see it, holds only the new
names.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from resurgo.errors import UnsupportedValueError

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(where: str, **old_to_new: str) -> Callable[[F], F]:
    """A decorator taking each keyword ``old`` of ``old_to_new`` as its new name: it warns
    (DeprecationWarning, pointing at the caller's line) and passes the value on under the new
    name; ``old`` and its new name both given raise UnsupportedValueError naming both. On a class
    (a dataclass: put it above ``@dataclass``), its ``__init__`` is wrapped so, and each ``old``
    becomes a read-only attribute that warns and reads the new one."""
    def wrap(fn: F) -> F:
        if isinstance(fn, type):
            fn.__init__ = wrap(fn.__init__)  # type: ignore[misc]
            for old, new in old_to_new.items():
                setattr(fn, old, _old_attribute(where, old, new))
            return fn

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old in kwargs:
                    kwargs[new] = take_renamed(where, old, new, kwargs)
            return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def take_renamed(where: str, old: str, new: str, kwargs: dict[str, Any], stacklevel: int = 3) -> Any:
    """Remove ``old`` from ``kwargs`` and return its value, warning that ``new`` replaces it;
    UnsupportedValueError when ``kwargs`` holds ``new`` too. ``stacklevel``: the caller's frame
    as :func:`warnings.warn` counts it from here (3: the caller of a wrapper that calls this)."""
    value = kwargs.pop(old)
    if new in kwargs:
        raise UnsupportedValueError(
            f"{where}: {old}={value!r} and {new}={kwargs[new]!r} were both given; {old}= is the "
            f"deprecated name of {new}=: pass {new}= only")
    warnings.warn(f"{where}({old}=...) is deprecated: pass {new}= instead (the same value; {old}= "
                  "goes in the next release)", DeprecationWarning, stacklevel=stacklevel)
    return value


def _old_attribute(where: str, old: str, new: str) -> property:
    """A read-only attribute ``old`` that reads ``new``, warning."""
    def read(self: Any) -> Any:
        warnings.warn(f"{where}.{old} is deprecated: read {new} instead (the same value; {old} goes in the next "
                      "release)", DeprecationWarning, stacklevel=2)
        return getattr(self, new)
    return property(read, doc=f"Deprecated: :attr:`{new}`.")
