"""Configuration keys: each one declared once, on the dataclass that holds it.

A key is a dataclass field: its type is the field's annotation, its default the field's,
and its metadata, from ``declare()``, gives its bounds and one line of doc.  Everything
else reads the declaration:

* ``check_fields`` (from the holder's ``__post_init__``) checks every value against its
  type and bounds, whoever built the object (Python, a file, a variable, JSON);
* ``decode`` builds a holder from one table of any source (a TOML section, vLLM's JSON,
  a test's dict), refusing an unknown key with its source and the nearest known key
  ("did you mean transfer_timeout_s?");
* ``parse_text`` reads a key's value from an environment variable's text;
* ``rows`` writes the reference table (``kvservice._reference`` renders the whole page,
  docs/configuration.md).

A refusal is a ``ConfigError`` whose message starts with the key (``port: must be
0..65535, got -1``); the one who knows where the value came from (the section, the file,
the variable) puts that in front.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ._results import ConfigError

__all__ = [
    "Declared", "check_fields", "declare", "declared", "decode", "parse_text", "quote", "refuse_unknown", "rows",
    "shown", "suggest",
]

#: what a refusal quotes of a value at most (a value may come from anyone's JSON)
MAX_QUOTE = 200
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def declare(doc: str, *, lo: float | None = None, hi: float | None = None, above: float | None = None,
            says: str | None = None, env: bool = True) -> dict[str, Any]:
    """A configuration key's declaration, as the metadata of its dataclass field
    (``port: int = field(default=0, metadata=declare("...", lo=0, hi=65535))``): its one line
    of ``doc``; ``lo``/``hi`` bound a number (or each number of a list) inclusively, ``above``
    exclusively; ``says`` is what a refusal says the value must be (derived from the bounds
    when not given); ``env=False``: not settable from an environment variable."""
    return {"doc": doc, "lo": lo, "hi": hi, "above": above, "says": says, "env": env}


@dataclass(frozen=True, slots=True)
class Declared:
    """One key as declared: name, type, default, bounds, doc."""

    name: str
    type: Any
    default: Any
    doc: str = ""
    lo: float | None = None
    hi: float | None = None
    above: float | None = None
    says: str | None = None
    env: bool = True

    @property
    def must(self) -> str | None:
        """What a refusal says the value must be (None: its type says it all)."""
        if self.says is not None:
            return self.says
        if typing.get_origin(self.type) is tuple and (self.lo, self.hi, self.above) != (None, None, None):
            return f"each {Declared(self.name, Any, None, lo=self.lo, hi=self.hi, above=self.above).must}"
        if self.above == 0 and self.lo is None and self.hi is None:
            return "must be a positive number"
        if self.lo is not None and self.hi is not None:
            return f"must be {_num(self.lo)}..{_num(self.hi)}"
        if self.lo is not None:
            return f"must be >= {_num(self.lo)}"
        if self.above is not None:
            return f"must be > {_num(self.above)}"
        if self.hi is not None:
            return f"must be <= {_num(self.hi)}"
        return None

    @property
    def allowed(self) -> str:
        """The values allowed, as the reference states them."""
        choices = _choices(self.type)
        if choices is not None:
            return "one of " + ", ".join(map(str, choices))
        must = self.must
        if must is not None:
            return must.removeprefix("must be ")
        return ""

    def check(self, value: Any) -> Any:
        """``value`` as this key holds it (a list as a tuple, an int as a float where a number
        is declared); ``ConfigError`` naming the key when it is not allowed."""
        ok, held = _conform(self.type, value)
        if not ok:
            scalar = (_optional(self.type) or self.type) in (int, float)
            says = self.says or (self.must if scalar else None) or _expected(self.type)
            raise ConfigError(f"{self.name}: {says}, got {quote(value)}")
        bounded = [held] if not isinstance(held, tuple) else list(held)
        for item in bounded:
            if isinstance(item, int | float) and not isinstance(item, bool) and not self._within(item):
                shown = quote(item) if isinstance(held, tuple) else quote(value)
                raise ConfigError(f"{self.name}: {self.must}, got {shown}")
        return held

    def _within(self, value: float) -> bool:
        return ((self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
                and (self.above is None or value > self.above))


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def quote(value: Any) -> str:
    """``repr(value)`` cut to ``MAX_QUOTE`` characters."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTE else f"{text[:MAX_QUOTE]}... ({len(text)} characters)"


def declared(cls: type[Any]) -> dict[str, Declared]:
    """The keys ``cls`` (a dataclass) declares, its own first, then those it inherits;
    a field declared without ``declare()`` is a key with its type and default, and no doc."""
    found = _DECLARED.get(cls)
    if found is None:
        found = _DECLARED[cls] = _declared(cls)
    return found


_DECLARED: dict[type[Any], dict[str, Declared]] = {}


def _declared(cls: type[Any]) -> dict[str, Declared]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    own = set(getattr(cls, "__annotations__", {}))
    ordered = [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]
    out: dict[str, Declared] = {}
    for f in ordered:
        default = f.default_factory() if f.default is dataclasses.MISSING \
            and f.default_factory is not dataclasses.MISSING else f.default
        meta = dict(f.metadata)
        out[f.name] = Declared(f.name, hints[f.name], default, meta.get("doc", ""), meta.get("lo"),
                               meta.get("hi"), meta.get("above"), meta.get("says"), meta.get("env", True))
    return out


def check_fields(obj: Any) -> None:
    """Check every declared key of the (frozen) dataclass ``obj``, storing each as it is held."""
    for name, decl in declared(type(obj)).items():
        value = getattr(obj, name)
        held = decl.check(value)
        if held is not value:
            object.__setattr__(obj, name, held)


#: a table with more keys than this is not listed in a refusal: the reference lists them
MAX_LISTED = 12


def suggest(word: str, known: Iterable[str]) -> str:
    """"did you mean X?" for the known word nearest ``word``, else what is known."""
    known = list(known)
    close = difflib.get_close_matches(word[:MAX_QUOTE], known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    if len(known) > MAX_LISTED:
        return f"none of its {len(known)} keys is near it (docs/configuration.md lists them)"
    return "allowed: " + ", ".join(known)


def shown(name: object) -> str:
    """A key or word as a refusal names it: as written when short and printable, else quoted."""
    text = str(name)
    if len(text) > MAX_QUOTE:
        return f"{text[:MAX_QUOTE]!r}... ({len(text)} characters)"
    return text if text.isprintable() else repr(text)


def refuse_unknown(table: Mapping[Any, Any], known: Iterable[str], *, where: str, origin: str = "") -> None:
    """``ConfigError`` for the first key of ``table`` that is not one of ``known``, naming it as
    ``where.KEY``, its ``origin`` (a file, a variable: "" when ``where`` says it) and the
    nearest known key."""
    known = list(known)
    for name in table:
        if name not in known:
            source = f" ({origin})" if origin else ""
            raise ConfigError(f"{where}.{shown(name)}{source}: unknown key; {suggest(str(name), known)}")


def decode(cls: type[Any], table: Any, *, where: str, origin: str = "", exclude: Iterable[str] = (),
           given: Mapping[str, Any] | None = None) -> Any:
    """``cls`` built from ``table`` (one section of a file, an object of JSON): every key known,
    every value of its type, then ``cls``' own checks.  A refusal names the key as
    ``where.KEY`` (and ``origin``, for an unknown key).  ``exclude``: keys ``table`` may not
    hold; ``given``: values set by the caller (a nested section already decoded)."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table of keys, got {quote(table)}")
    keys = {name: decl for name, decl in declared(cls).items() if name not in set(exclude)}
    refuse_unknown(table, keys, where=where, origin=origin)
    values: dict[str, Any] = {}
    for name, value in table.items():
        try:
            values[name] = keys[name].check(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from exc
    try:
        return cls(**values, **(given or {}))
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from exc
    except ValueError as exc:  # a holder that raises ValueError names the key after its type ("KVLayout.x")
        text = str(exc)
        text = text[len(cls.__name__):] if text.startswith((f"{cls.__name__}.", f"{cls.__name__}:")) else f".{text}"
        raise ConfigError(f"{where}{text}") from exc


def parse_text(decl: Declared, text: str) -> Any:
    """The value an environment variable's ``text`` gives key ``decl`` (checked later, with the
    file's values); ``ValueError`` saying what was expected when it cannot be read."""
    tp = decl.type
    if not decl.env:
        raise ValueError("cannot be set from the environment; use the file")
    inner = _optional(tp)
    if inner is not None:
        if text == "":
            return None
        tp = inner
    if tp is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    elif tp is int:
        try:
            return int(text)
        except ValueError:
            pass
    elif tp is float:
        try:
            return float(text)
        except ValueError:
            pass
    elif tp is str or _choices(tp) is not None:
        return text
    elif typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        try:
            return [int(part.strip()) if item is int else part.strip() for part in text.split(",") if part.strip()]
        except ValueError:
            pass
    else:
        raise ValueError("cannot be set from the environment; use the file")
    raise ValueError(_expected(decl.type))


def rows(cls: type[Any], *, docs: Mapping[str, str] | None = None, exclude: Iterable[str] = (),
         env: Callable[[str], str] | None = None) -> list[str]:
    """The reference table of ``cls``' keys, in Markdown: key, type, default, allowed, doc
    (``docs`` for a holder that does not declare its own), and the variable when ``env``
    names it."""
    head = ["key", "type", "default", "allowed", "what it is"] + (["variable"] if env else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, decl in declared(cls).items():
        if name in set(exclude):
            continue
        doc = decl.doc or (docs or {}).get(name, "")
        cells = [f"`{name}`", _type_name(decl.type), f"`{_shown_default(decl.default)}`", decl.allowed, doc]
        if env:
            cells.append(f"`{env(name)}`" if decl.env else "(file only)")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def _shown_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_shown_default(v) for v in value) + "]"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Mapping):
        return "{}" if not value else str(dict(value))
    if dataclasses.is_dataclass(value):
        return type(value).__name__ + "()"
    return repr(value)


def _type_name(tp: Any) -> str:
    inner = _optional(tp)
    if inner is not None:
        return f"{_type_name(inner)} or none"
    if _choices(tp) is not None:
        return "string"
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) in (Mapping, dict):
        return "table of strings"
    return {bool: "bool", int: "int", float: "number", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


# -- types ---------------------------------------------------------------------------------


def _optional(tp: Any) -> Any:
    """``X`` for ``X | None``, else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _choices(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _expected(tp: Any) -> str:
    """What a value of type ``tp`` is, as a refusal says it."""
    inner = _optional(tp)
    if inner is not None:
        return f"{_expected(inner)} (or none: \"\" in a file)"
    choices = _choices(tp)
    if choices is not None:
        return "must be one of " + ", ".join(map(str, choices))
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        return "expected a list of integers" if item is int else "expected a list of strings"
    if typing.get_origin(tp) in (Mapping, dict):
        return "expected a table of strings"
    return "expected " + {bool: "true or false", int: "an integer", float: "a number",
                          str: "a string"}.get(tp, f"a {getattr(tp, '__name__', tp)}")


def _conform(tp: Any, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` is of type ``tp``, and the value as held."""
    inner = _optional(tp)
    if inner is not None:
        return (True, None) if value is None else _conform(inner, value)
    if tp is Any:
        return True, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok and not isinstance(value, float) else value
    if tp is str:
        return isinstance(value, str), value
    choices = _choices(tp)
    if choices is not None:
        return any(type(value) is type(c) and value == c for c in choices), value
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        held = []
        for item in value:
            ok, item = _conform(typing.get_args(tp)[0], item)
            if not ok:
                return False, value
            held.append(item)
        return True, value if isinstance(value, tuple) and held == list(value) else tuple(held)
    if origin in (Mapping, dict):
        ok = isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in value.items())
        return ok, value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value
