"""One registry for every plug-in kind (transports, stages, routers), in the manner of fsspec's.

Built-in implementations are ``"module:Class"`` strings with an install hint, imported only when
asked for; third-party ones arrive through an entry-point group, e.g.::

    [project.entry-points."pdflow.stages"]
    redact = "mypkg.redact:RedactStage"

A plug-in may also be named directly as ``"module:Class"`` (handy in a notebook or a topology
file next to your own module), or passed as the class itself where code builds a pipeline.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any


def import_target(target: str) -> Any:
    """``"package.module:Attr"`` -> the attribute (ImportError or AttributeError if missing)."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{target!r} is not of the form 'module:Class'")
    return getattr(importlib.import_module(module), attr)


class Registry:
    """The implementations of one plug-in kind: built-ins, entry points, and ``module:Class``."""

    def __init__(self, kind: str, group: str, base: type | str, builtin: dict[str, tuple[str, str]]):
        """``base``: the class every implementation derives from, or its ``"module:Class"``
        name (imported at the first lookup, so that a registry imports nothing of its kind)."""
        self.kind, self.group, self._base = kind, group, base
        self.builtin = builtin  # name -> ("module:Class", install hint)
        self._found: dict[str, type | str] = {}
        self._entry_points: dict[str, importlib.metadata.EntryPoint] | None = None

    @property
    def base(self) -> type:
        if isinstance(self._base, str):
            self._base = import_target(self._base)
        return self._base

    def entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}
        return self._entry_points

    def refresh(self) -> None:
        """Forget what was looked up (after installing a plug-in into a running interpreter)."""
        self._found.clear()
        self._entry_points = None

    def names(self) -> list[str]:
        """Every known name: the built-in ones, then those from entry points."""
        return [*self.builtin, *(name for name in self.entry_points() if name not in self.builtin)]

    def knows(self, name: str) -> bool:
        return name in self.builtin or name in self.entry_points() or ":" in name

    def module_of(self, name: str | type) -> str | None:
        """The module that ``name``'s implementation lives in, found without importing it (None:
        an unknown name)."""
        if isinstance(name, type):
            return name.__module__
        if name in self.builtin:
            return self.builtin[name][0].partition(":")[0]
        if name in self.entry_points():
            return self.entry_points()[name].module
        module, colon, _ = name.partition(":")
        return module if colon and module else None

    def _resolve(self, name: str) -> type | str:
        """The class, or a one-line reason it cannot be used (imports at most once per name)."""
        if name in self.builtin:
            target, hint = self.builtin[name]
            try:
                cls = import_target(target)
            except (ImportError, AttributeError) as exc:
                return f"{self.kind} {name!r} is not available ({exc})" + (f": {hint}" if hint else "")
        elif name in self.entry_points():
            ep = self.entry_points()[name]
            try:
                cls = ep.load()
            except Exception as exc:  # a broken plug-in must not break the registry
                return f"{self.kind} {name!r} (entry point {ep.value}) failed to load: {exc!r}"
        elif ":" in name:
            try:
                cls = import_target(name)
            except (ImportError, AttributeError, ValueError) as exc:
                return f"{self.kind} {name!r} cannot be imported: {exc}"
        else:
            return f"unknown {self.kind} {name!r}; known: {', '.join(self.names())} (or 'module:Class')"
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            return f"{self.kind} {name!r} resolves to {cls!r}, which is not a {self.base.__module__}.{self.base.__qualname__}"
        return cls

    def resolve(self, name: str) -> type | str:
        found = self._found.get(name)
        if found is None:
            found = self._found[name] = self._resolve(name)
        return found

    def availability(self, name: str | type) -> str | None:
        """None if ``name`` can be used in this environment, else why not (with the hint)."""
        if isinstance(name, type):
            return None if issubclass(name, self.base) else f"{name!r} is not a {self.base.__qualname__}"
        found = self.resolve(name)
        return found if isinstance(found, str) else None

    def load(self, name: str | type) -> type:
        """The class for ``name``; LookupError if unknown, ImportError if it cannot be imported."""
        if isinstance(name, type):
            if problem := self.availability(name):
                raise TypeError(problem)
            return name
        found = self.resolve(name)
        if isinstance(found, str):
            if not self.knows(name):
                raise LookupError(found)
            raise ImportError(found)
        return found


def spec_name(kind: str | type) -> str:
    """How a kind given as a name or a class is written in messages and logs."""
    return kind if isinstance(kind, str) else f"{kind.__module__}:{kind.__qualname__}"
