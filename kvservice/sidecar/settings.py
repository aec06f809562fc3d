"""The sidecar's configuration: one frozen ``SidecarConfig`` from a TOML file
plus ``KVSERVICE_<SECTION>_<KEY>`` environment overrides.

``msgspec`` decodes the file into typed sections: the types, ranges and allowed
values are the annotations below (``Meta`` constraints, ``Literal`` choices), and
``[service]`` and ``[layout]`` decode straight into the core's ``ServiceConfig``
and ``KVLayout``, whose own checks run unchanged (one concept, one place).  This
module turns msgspec's errors (``Expected `int` >= 0 - at `$.http.port```) into
messages that name the key, the value and what is allowed::

    [sidecar]  roles, socket_path, shm_name, ...     -> DaemonSettings
    [http]     host, port                            -> HttpSettings
    [log]      level, format                         -> LogSettings
    [service]  host, port, drain_grace_s, ...        -> ServiceConfig (minus layout)
    [service.ucx_env]  UCX_* = "..."                 -> ServiceConfig.ucx_env
    [layout]   layers, page_tokens, ..., num_pages   -> KVLayout

TOML has no null: ``""`` stands for None in optional keys.  Environment variables
``KVSERVICE_<SECTION>_<KEY>`` (``KVSERVICE_HTTP_PORT=0``) win over the file.  A
variable naming a known section but an unknown key is an error; variables of
other sections are left alone (other tools share the prefix).
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from .._config import ConfigError, ServiceConfig
from ..memory._layout import KVLayout
from .shm import check_shm_name

ENV_PREFIX = "KVSERVICE_"
ROLES: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
#: sun_path is 108 bytes on Linux, including the terminating NUL
MAX_SOCKET_PATH = 107
#: uid_t is 32 bits and (uid_t)-1 means "no change"
MAX_ID = 2**32 - 2
#: short aliases for the most asked-for keys: variable -> section.key
ENV_ALIASES = {
    f"{ENV_PREFIX}AUTH_KEY_FILE": "service.auth_key_file",
    f"{ENV_PREFIX}ALLOW_UNAUTHENTICATED": "service.allow_unauthenticated",
    # discovery (docs/cluster.md): what a pod's manifest sets
    f"{ENV_PREFIX}DISCOVERY": "service.discovery",
    f"{ENV_PREFIX}CLUSTER": "service.cluster",
    f"{ENV_PREFIX}ETCD_ENDPOINTS": "service.etcd_endpoints",
}


def _allowed(text: str, **constraints: Any) -> msgspec.Meta:
    """A constraint and how an error message states it."""
    return msgspec.Meta(description=text, **constraints)


class DaemonSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[sidecar]``: what the daemon serves and where workers find it."""

    #: which halves of the API this daemon serves: "prefill" (send), "decode" (expect)
    roles: Annotated[tuple[Literal["prefill", "decode"], ...],
                     _allowed(f"must be a non-empty list of distinct {list(ROLES)}", min_length=1)] = ROLES
    #: the workers' Unix socket (created mode 0600); at most MAX_SOCKET_PATH bytes
    socket_path: str = "/tmp/kvservice.sock"
    #: name of the shared KV pool segment, under /dev/shm
    shm_name: str = "kvservice"
    max_clients: Annotated[int, _allowed("must be a positive int", gt=0)] = 64
    #: largest frame a worker may send
    max_frame_bytes: Annotated[int, _allowed("must be >= 65536", ge=64 * 1024)] = 4 * 1024 * 1024
    #: where to write the ready line (JSON) once serving; "" for none
    ready_file: str | None = None
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    #: uids besides the daemon's own that may connect (SO_PEERCRED); root only if listed
    allowed_uids: tuple[Annotated[int, _allowed(f"each a uid 0..{MAX_ID}", ge=0, le=MAX_ID)], ...] = ()
    #: group (name or gid) given read-write access to the socket and the segment
    #: (mode 0660 instead of 0600), so that workers of ``allowed_uids`` in it can use them
    group: str | None = None

    def __post_init__(self) -> None:
        # what a type cannot say: distinct roles, a length in bytes, a name on this host
        if len(set(self.roles)) != len(self.roles):
            raise ConfigError(f"roles: must be a non-empty list of distinct {list(ROLES)}, got {list(self.roles)!r}")
        if not self.socket_path or len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"socket_path: must be 1..{MAX_SOCKET_PATH} bytes, got {self.socket_path!r}")
        try:
            check_shm_name(self.shm_name)
        except ValueError as exc:
            raise ConfigError(f"shm_name: {exc}") from exc
        if self.group is not None:
            self.gid  # noqa: B018 - resolves it, raising ConfigError for an unknown group

    @property
    def gid(self) -> int | None:
        """``group`` as a gid (None: no group access)."""
        if self.group is None:
            return None
        if self.group.isdigit():
            if int(self.group) > MAX_ID:
                raise ConfigError(f"group: a gid is 0..{MAX_ID}, got {self.group!r}")
            return int(self.group)
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ConfigError(f"group: no such group on this host: {self.group!r}") from None


class HttpSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[http]``: /healthz, /readyz, /metrics."""

    host: Annotated[str, _allowed("must not be empty", min_length=1)] = "127.0.0.1"
    #: 0 picks a free port (reported in the ready line)
    port: Annotated[int, _allowed("must be 0..65535", ge=0, le=65535)] = 9400


class LogSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[log]``: the entry point's log output on stderr."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    #: auto: console on a terminal, JSON lines otherwise
    format: Literal["auto", "json", "console"] = "auto"


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything ``kvservice serve`` needs; build it with ``load()``."""

    sidecar: DaemonSettings = field(default_factory=DaemonSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    log: LogSettings = field(default_factory=LogSettings)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    #: where each value came from when not the file: "section.key" -> "KVSERVICE_..."
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def layout(self) -> KVLayout:
        return self.service.layout


class _Sections(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The file as msgspec decodes it: ``[layout]`` is moved into ``service`` first."""

    sidecar: DaemonSettings = msgspec.field(default_factory=DaemonSettings)
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)


#: TOML section -> the type it maps onto
SECTIONS: dict[str, type[Any]] = {
    "sidecar": DaemonSettings,
    "http": HttpSettings,
    "log": LogSettings,
    "service": ServiceConfig,
    "layout": KVLayout,
}
_NOT_KEYS = {"service": {"layout"}}  # set through another section


def keys(section: str) -> dict[str, Any]:
    """The keys of ``section`` and their types (``Annotated`` constraints stripped)."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    names = cls.__struct_fields__ if issubclass(cls, msgspec.Struct) else [f.name for f in dataclasses.fields(cls)]
    skip = _NOT_KEYS.get(section, set())
    return {name: _bare(hints[name]) for name in names if name not in skip}


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated`` metadata, at any depth."""
    if typing.get_origin(tp) is Annotated:
        return _bare(typing.get_args(tp)[0])
    if typing.get_origin(tp) is tuple:
        return tuple[_bare(typing.get_args(tp)[0]), ...]  # type: ignore[misc]
    return tp


def _meta(section: str, key: str) -> tuple[str | None, bool]:
    """How the annotation of ``section.key`` states what is allowed (None: it does not say),
    and whether that is said of each item of a list rather than of the whole value."""
    tp = typing.get_type_hints(SECTIONS[section], include_extras=True).get(key)
    of_items = False
    while tp is not None:
        if typing.get_origin(tp) is Annotated:
            for extra in typing.get_args(tp)[1:]:
                if isinstance(extra, msgspec.Meta) and extra.description:
                    return extra.description, of_items
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is Literal:
            return "must be one of " + ", ".join(typing.get_args(tp)), of_items
        elif typing.get_origin(tp) is tuple:
            tp, of_items = typing.get_args(tp)[0], True
        else:
            break
    return None, False


# -- loading ---------------------------------------------------------------------------


def load(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None, *,
         defaults: Mapping[str, Mapping[str, Any]] | None = None) -> SidecarConfig:
    """Read ``path`` (None: defaults only), apply ``env`` overrides, validate.  Raises ``ConfigError``.

    ``defaults`` ("section" -> {key: value}) stand under the file: a host's own settings
    (SGLang's timeouts) that apply unless the file or the environment sets the key."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = msgspec.toml.decode(f.read())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {exc.strerror}") from exc
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{os.fspath(path)}: invalid TOML: {exc}") from exc
    for section, table in (defaults or {}).items():
        given = raw.setdefault(section, {})
        if isinstance(given, dict):  # not a table: from_mapping names the error
            raw[section] = {**table, **given}
    return from_mapping(raw, os.environ if env is None else env)


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> SidecarConfig:
    values: dict[str, Any] = {}
    for section, table in raw.items():
        if section in SECTIONS and not isinstance(table, dict):
            raise ConfigError(f"{section}: must be a table ([{section}]), got {table!r}")
        values[section] = dict(table) if isinstance(table, dict) else table
    if "layout" in values.get("service", {}):
        raise ConfigError(f"service.layout: unknown key; allowed: {', '.join(keys('service'))}")
    sources: dict[str, str] = {}
    for var, text in sorted((env or {}).items()):
        if not var.startswith(ENV_PREFIX):
            continue
        if var in ENV_ALIASES:
            section, _, key = ENV_ALIASES[var].partition(".")
        else:
            section, _, key = var[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS:
            continue
        allowed = keys(section)
        if key not in allowed:
            raise ConfigError(f"{var}: {section}.{key!s} is not a key; allowed: {', '.join(allowed)}")
        name = f"{section}.{key}"
        value = _from_env(name, var, text, allowed[key])
        table = values.setdefault(section, {})
        if name in sources and table[key] != value:
            raise ConfigError(f"{name}: {sources[name]} and {var} disagree; set one of them")
        table[key] = value
        sources[name] = var
    for section, table in values.items():
        if section in SECTIONS:
            for key, tp in keys(section).items():
                if table.get(key) == "" and _optional(tp) is not None:
                    table[key] = None  # TOML has no null
    layout = values.pop("layout", {})
    values["service"] = {**values.get("service", {}), "layout": layout}
    try:
        decoded = msgspec.convert(values, _Sections, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), values, sources, env)) from exc
    return SidecarConfig(sidecar=decoded.sidecar, http=decoded.http, log=decoded.log, service=decoded.service,
                         sources=sources)


_AT = re.compile(r" - at `\$(.*)`$")
_TYPE_ERROR = re.compile(r"^Expected `[^`]+`, got `[^`]+`$")


def _explain(message: str, values: Mapping[str, Any], sources: Mapping[str, str],
             env: Mapping[str, str] | None) -> str:
    """msgspec's ``Expected `int` >= 0 - at `$.http.port``` as ``http.port: must be 0..65535, got -1``."""
    at = _AT.search(message)
    path = re.findall(r"\.(\w+)", at.group(1)) if at else []
    message = message[:at.start()] if at else message
    if path[:2] == ["service", "layout"]:  # [layout] was decoded inside [service]
        path = path[1:]
    if not path:
        unknown = re.match(r"Object contains unknown field `(.*)`", message)
        return f"{unknown.group(1) if unknown else '?'}: unknown section; allowed: {', '.join(SECTIONS)}"
    section = path[0]
    table = values.get(section, {}) if section != "layout" else values["service"].get("layout", {})
    unknown = re.match(r"Object contains unknown field `(.*)`", message)
    if unknown:
        return f"{section}.{unknown.group(1)}: unknown key; allowed: {', '.join(keys(section))}"
    if len(path) == 1:  # raised by the section's own checks: "key: what is wrong"
        if section == "layout":  # KVLayout says "KVLayout.num_pages must ..."
            return message.replace("KVLayout.", "layout.").replace("KVLayout:", "layout:")
        key, sep, rest = message.partition(": ")
        var = sources.get(f"{section}.{key}") if sep else None
        if var is not None and env is not None:  # say which variable set the bad value
            return f"{section}.{key} (from {var}={env[var]!r}): {rest}"
        return f"{section}.{message}"
    key = path[1]
    name, value = f"{section}.{key}", table.get(key)
    item = re.match(rf"\.{key}\[(\d+)\]", at.group(1)[len(f".{path[0]}"):] if at else "")
    shown = repr(value[int(item.group(1))]) if item and isinstance(value, list) else repr(value)
    var = sources.get(name)
    if var is not None and env is not None:
        name = f"{name} (from {var}={env[var]!r})"
    allowed, of_items = _meta(section, key)
    if _TYPE_ERROR.match(message) or allowed is None:
        return f"{name}: expected {_describe(keys(section)[key])}, got {value!r}"
    return f"{name}: {allowed}, got {shown if of_items else repr(value)}"


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str or typing.get_origin(tp) is Literal:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "a list of integers" if typing.get_args(tp)[0] is int else "a list of strings"
    if origin is Mapping or origin is dict:
        return "a table of strings"
    if _optional(tp) is not None:
        return f"{_describe(_optional(tp))} (\"\" for none)"
    return str(tp)


def _optional(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_env(name: str, var: str, text: str, tp: Any) -> Any:
    """Parse an environment variable's text as the key's type (checked with the file's values)."""
    inner = _optional(tp)
    if inner is not None:
        return None if text == "" else _from_env(name, var, text, inner)
    try:
        if tp is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str or typing.get_origin(tp) is Literal:
            return text
        if typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            convert = int if item is int else str
            return [convert(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        pass
    else:
        raise ConfigError(f"{name} (from {var}={text!r}): cannot be set from the environment; use the file")
    raise ConfigError(f"{name} (from {var}={text!r}): expected {_describe(tp)}")


# -- printing (check-config) --------------------------------------------------------------


def to_toml(cfg: SidecarConfig) -> str:
    """The effective configuration as TOML that ``load`` reads back to an equal config."""
    objects: dict[str, Any] = {
        "sidecar": cfg.sidecar, "http": cfg.http, "log": cfg.log,
        "service": cfg.service, "layout": cfg.service.layout,
    }
    lines: list[str] = []
    tables: list[str] = []
    for section, obj in objects.items():
        lines.append(f"[{section}]")
        for key, tp in keys(section).items():
            value = getattr(obj, key)
            note = f"  # from {cfg.sources[f'{section}.{key}']}" if f"{section}.{key}" in cfg.sources else ""
            if typing.get_origin(tp) in (Mapping, dict):
                tables.append(f"\n[{section}.{key}]")
                tables.extend(f"{k} = {_toml_value(v)}" for k, v in sorted(value.items()))
            elif value is None:
                lines.append(f"{key} = \"\"{note}")
            else:
                lines.append(f"{key} = {_toml_value(value)}{note}")
        lines.extend(tables)
        tables = []
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
