"""The sidecar's configuration: one frozen ``SidecarConfig`` from a TOML file
plus ``KVSERVICE_<SECTION>_<KEY>`` environment overrides.

Sections map onto frozen dataclasses.  ``[service]`` and ``[layout]`` map onto
the core's ``ServiceConfig`` and ``KVLayout``, whose own checks run unchanged;
this module only checks types, names unknown keys, and prefixes each message
with the key it concerns, so every error reads ``section.key: ...``::

    [sidecar]  roles, socket_path, shm_name, ...     -> DaemonSettings
    [http]     host, port                            -> HttpSettings
    [log]      level, format                         -> LogSettings
    [service]  host, port, drain_grace_s, ...        -> ServiceConfig (minus layout)
    [service.ucx_env]  UCX_* = "..."                 -> ServiceConfig.ucx_env
    [layout]   layers, page_tokens, ..., num_pages   -> KVLayout

Environment variables ``KVSERVICE_<SECTION>_<KEY>`` (``KVSERVICE_HTTP_PORT=0``)
win over the file.  A variable naming a known section but an unknown key is an
error; variables of other sections are left alone (other tools share the prefix).
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._config import LOOPS, ConfigError, ServiceConfig
from ..memory._layout import KVLayout
from .shm import check_shm_name

ENV_PREFIX = "KVSERVICE_"
ROLES = ("prefill", "decode")
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
}


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """``[sidecar]``: what the daemon serves and where workers find it."""

    #: which halves of the API this daemon serves: "prefill" (send), "decode" (expect)
    roles: tuple[str, ...] = ROLES
    #: the workers' Unix socket (created mode 0600)
    socket_path: str = "/tmp/kvservice.sock"
    #: name of the shared KV pool segment, under /dev/shm
    shm_name: str = "kvservice"
    max_clients: int = 64
    #: largest frame a worker may send
    max_frame_bytes: int = 4 * 1024 * 1024
    #: where to write the ready line (JSON) once serving; "" for none
    ready_file: str | None = None
    loop: str = "auto"
    #: uids besides the daemon's own that may connect (SO_PEERCRED); root only if listed
    allowed_uids: tuple[int, ...] = ()
    #: group (name or gid) given read-write access to the socket and the segment
    #: (mode 0660 instead of 0600), so that workers of ``allowed_uids`` in it can use them
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.roles or any(r not in ROLES for r in self.roles) or len(set(self.roles)) != len(self.roles):
            raise ConfigError(f"roles: must be a non-empty list of distinct {list(ROLES)}, got {list(self.roles)!r}")
        if not self.socket_path or len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"socket_path: must be 1..{MAX_SOCKET_PATH} bytes, got {self.socket_path!r}")
        try:
            check_shm_name(self.shm_name)
        except ValueError as exc:
            raise ConfigError(f"shm_name: {exc}") from exc
        if self.max_clients <= 0:
            raise ConfigError(f"max_clients: must be a positive int, got {self.max_clients!r}")
        if self.max_frame_bytes < 64 * 1024:
            raise ConfigError(f"max_frame_bytes: must be >= 65536, got {self.max_frame_bytes!r}")
        if self.loop not in LOOPS:
            raise ConfigError(f"loop: must be one of {', '.join(LOOPS)}, got {self.loop!r}")
        bad = [uid for uid in self.allowed_uids if isinstance(uid, bool) or not 0 <= uid <= MAX_ID]
        if bad:
            raise ConfigError(f"allowed_uids: each a uid 0..{MAX_ID}, got {bad[0]!r}")
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


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """``[http]``: /healthz, /readyz, /metrics."""

    host: str = "127.0.0.1"
    #: 0 picks a free port (reported in the ready line)
    port: int = 9400

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be 0..65535, got {self.port!r}")


@dataclass(frozen=True, slots=True)
class LogSettings:
    """``[log]``: structlog output on stderr."""

    level: str = "info"
    #: auto: console on a terminal, JSON lines otherwise
    format: str = "auto"

    def __post_init__(self) -> None:
        if self.level.lower() not in LOG_LEVELS:
            raise ConfigError(f"level: must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ConfigError(f"format: must be one of {', '.join(LOG_FORMATS)}, got {self.format!r}")


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


#: TOML section -> the dataclass it maps onto
SECTIONS: dict[str, type[Any]] = {
    "sidecar": DaemonSettings,
    "http": HttpSettings,
    "log": LogSettings,
    "service": ServiceConfig,
    "layout": KVLayout,
}
_NOT_KEYS = {"service": {"layout"}}  # set through another section


def keys(section: str) -> dict[str, Any]:
    """The keys of ``section`` and their types."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    skip = _NOT_KEYS.get(section, set())
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in skip}


# -- loading ---------------------------------------------------------------------------


def load(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None) -> SidecarConfig:
    """Read ``path`` (None: defaults only), apply ``env`` overrides, validate.  Raises ``ConfigError``."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{os.fspath(path)}: invalid TOML: {exc}") from exc
    return from_mapping(raw, os.environ if env is None else env)


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> SidecarConfig:
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section; allowed: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: must be a table ([{section}]), got {table!r}")
        allowed = keys(section)
        for key, value in table.items():
            if key not in allowed:
                raise ConfigError(f"{section}.{key}: unknown key; allowed: {', '.join(allowed)}")
            values[section][key] = _coerce(f"{section}.{key}", value, allowed[key])
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
        if name in sources and values[section][key] != value:
            raise ConfigError(f"{name}: {sources[name]} and {var} disagree; set one of them")
        values[section][key] = value
        sources[name] = var
    return SidecarConfig(
        sidecar=_build("sidecar", values["sidecar"], sources, env),
        http=_build("http", values["http"], sources, env),
        log=_build("log", values["log"], sources, env),
        service=_build("service", {**values["service"], "layout": _build("layout", values["layout"], sources, env)},
                       sources, env),
        sources=sources,
    )


def _build(section: str, values: dict[str, Any], sources: Mapping[str, str],
           env: Mapping[str, str] | None) -> Any:
    try:
        return SECTIONS[section](**values)
    except (ConfigError, ValueError) as exc:
        msg = str(exc)
        if section == "layout":  # KVLayout says "KVLayout.num_pages must ..."
            msg = msg.replace("KVLayout.", "layout.").replace("KVLayout:", "layout:")
            raise ConfigError(msg) from exc
        key, sep, rest = msg.partition(": ")
        var = sources.get(f"{section}.{key}") if sep else None
        if var is not None and env is not None:  # say which variable set the bad value
            raise ConfigError(f"{section}.{key} (from {var}={env[var]!r}): {rest}") from exc
        raise ConfigError(f"{section}.{msg}") from exc


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
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


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check a TOML value against the key's type."""
    inner = _optional(tp)
    if inner is not None:
        return None if value == "" else _coerce(name, value, inner)
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        ok = isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
    elif typing.get_origin(tp) in (Mapping, dict):
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        value = dict(value) if ok else value
    if not ok:
        raise ConfigError(f"{name}: expected {_describe(tp)}, got {value!r}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_env(name: str, var: str, text: str, tp: Any) -> Any:
    """Parse an environment variable's text as the key's type."""
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
        if tp is str:
            return text
        if typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            return tuple(item(part.strip()) for part in text.split(",") if part.strip())
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
