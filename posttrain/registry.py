"""Name → callable registries with TRL's public strings as keys.

A registry is a plain dict with a ``register`` decorator and a ``get`` that accepts either a registered name or a
callable (passed through unchanged). Unknown names raise a ``ValueError`` that lists the valid names, so a typo in a
config or on the command line says what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping from public string keys to objects (usually functions).

    Args:
        kind: What the registry holds, used in error messages (e.g. ``"loss_type"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None, *, overwrite: bool = False) -> Callable[[T], T]:
        """Decorator registering an object under ``name`` (default: its ``__name__``)."""

        def decorator(obj: T) -> T:
            key = name or getattr(obj, "__name__", None)
            if not key:
                raise ValueError(f"Cannot register {obj!r} in the {self.kind} registry without a name.")
            if key in self._items and not overwrite:
                raise ValueError(f"{self.kind} {key!r} is already registered.")
            self._items[key] = obj
            return obj

        return decorator

    def add(self, name: str, obj: T, *, overwrite: bool = False) -> T:
        """Register ``obj`` under ``name`` without the decorator syntax."""
        return self.register(name, overwrite=overwrite)(obj)

    def get(self, key: str | T) -> T:
        """Return the object registered under ``key``; a non-string ``key`` (e.g. a callable) is returned as is."""
        if not isinstance(key, str):
            if callable(key):
                return key
            raise TypeError(f"Expected a {self.kind} name (str) or a callable, got {type(key).__name__}: {key!r}.")
        try:
            return self._items[key]
        except KeyError:
            raise ValueError(f"Unknown {self.kind} {key!r}. Valid names: {', '.join(sorted(self._items))}.") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, key: str) -> T:
        return self.get(key)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def resolve_many(registry: Registry[Any], keys: Any) -> list[Any]:
    """Resolve a single key or a list of keys/callables through ``registry``."""
    if isinstance(keys, (str,)) or callable(keys):
        keys = [keys]
    return [registry.get(k) for k in keys]
