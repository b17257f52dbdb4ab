"""Small immutable records without :mod:`dataclasses`.

kubelet starts the driver anew for every call, and ``@dataclass`` builds each class's
methods by compiling source text when the module is imported (about a millisecond a class),
after importing :mod:`inspect` (with ``ast``, ``dis``, ``tokenize`` and their regular
expressions). The records every ``mount`` loads (a volume, a journal record, a mount-table
entry, a command's result) derive from :class:`Frozen` instead: the fields are the class's
``__slots__`` (in order), ``__init__`` is written out, and equality, hashing, ``repr`` and
:meth:`Frozen.replace` behave as a frozen dataclass's do (``tests/node/test_frozen.py``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's (see flexhub.node)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _F = TypeVar("_F", bound="Frozen")

__all__ = ["Frozen"]


class Frozen:
    """Base of an immutable record whose fields are its ``__slots__``.

    A subclass lists its fields in ``__slots__`` and sets them in ``__init__`` through
    :meth:`_set`; ``_compare`` names the fields that equality and the hash use (default: all).
    Backends reach it as ``flexhub.backend.Frozen`` for their own records.

    .. versionadded:: 0.3 (public)
    """

    __slots__ = ()
    _compare: tuple[str, ...] | None = None  # not ClassVar: typing.get_type_hints() resolves it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # What would otherwise pass silently: a record without its own ``__slots__`` (its
        # fields in a ``__dict__``, unseen by equality, ``repr`` and pickling), one string
        # instead of a tuple of names, or a record derived from another (``fields()`` would
        # name the subclass's slots only).
        super().__init_subclass__(**kwargs)
        slots = cls.__dict__.get("__slots__")
        if not isinstance(slots, tuple) or not all(isinstance(name, str) for name in slots):
            raise TypeError(f"{cls.__qualname__}: a Frozen record lists its fields in __slots__")
        if any(issubclass(base, Frozen) and base.__slots__ for base in cls.__mro__[1:]):
            raise TypeError(f"{cls.__qualname__}: derive a record from Frozen itself")

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The field names, in order."""
        slots: tuple[str, ...] = cls.__slots__
        return slots

    def _key(self) -> tuple[object, ...]:
        names = self._compare if self._compare is not None else self.fields()
        return tuple(getattr(self, name) for name in names)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")  # as dataclasses' frozen

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Frozen)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.fields())
        return f"{type(self).__qualname__}({shown})"

    def __reduce__(self) -> tuple[type[Frozen], tuple[object, ...]]:
        # copy, deepcopy and pickle rebuild through __init__ (its parameters are the fields,
        # in order), never through the __setattr__ that refuses
        return (type(self), tuple(getattr(self, name) for name in self.fields()))

    def as_dict(self) -> dict[str, Any]:
        """The fields and their values (not copied)."""
        return {name: getattr(self, name) for name in self.fields()}

    def replace(self: _F, **changes: Any) -> _F:
        """A copy with ``changes`` (as :func:`dataclasses.replace`).

        :raises TypeError: a name that is not a field.
        """
        unknown = set(changes) - set(self.fields())
        if unknown:
            raise TypeError(f"{type(self).__qualname__} has no field {sorted(unknown)[0]!r}")
        return type(self)(**{**self.as_dict(), **changes})
