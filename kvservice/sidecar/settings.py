"""The sidecar's configuration: one frozen ``SidecarConfig`` from a TOML file
plus ``KVSERVICE_<SECTION>_<KEY>`` environment overrides.

Every key is declared once, on the type its section maps onto (``kvservice._settings.declare``:
type, default, bounds, one line of doc), and every source is decoded through that
declaration (``_settings.decode``): an unknown section, key or variable is refused naming
it, where it came from and the nearest known one; a bad value names the key, the value and
what is allowed::

    [sidecar]  roles, socket_path, shm_name, ...     -> DaemonSettings
    [http]     host, port                            -> HttpSettings
    [log]      level, format                         -> LogSettings
    [service]  host, port, drain_grace_s, ...        -> ServiceConfig (minus layout)
    [service.ucx_env]  UCX_* = "..."                 -> ServiceConfig.ucx_env
    [layout]   layers, page_tokens, ..., num_pages   -> KVLayout

TOML has no null: ``""`` stands for None in optional keys.  Environment variables
``KVSERVICE_<SECTION>_<KEY>`` (``KVSERVICE_HTTP_PORT=0``) win over the file.  A
variable naming a known section but an unknown key is an error, and so is one whose
section is a near miss of a known one (``KVSERVICE_SERVCE_PORT``); variables of other
words are left alone (other tools share the prefix).  docs/configuration.md is the
reference generated from these declarations (``python -m kvservice._reference``).
"""

from __future__ import annotations

import difflib
import grp
import json
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec

from .._config import ConfigError, Loop, ServiceConfig
from .._settings import check_fields, declare, declared, decode, parse_text, shown, suggest
from ..memory._layout import DTYPE_SIZES, KVLayout
from .shm import check_shm_name

ENV_PREFIX = "KVSERVICE_"
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
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
#: how near a variable's section (or the whole variable, to an alias) must be to a known one
#: to be taken for a typo of it rather than another tool's variable
NEAR_SECTION, NEAR_ALIAS = 0.75, 0.8


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """``[sidecar]``: what the daemon serves and where workers find it."""

    roles: tuple[Role, ...] = field(default=ROLES, metadata=declare(
        "which halves of the API this daemon serves: prefill (send), decode (expect)",
        says=f"must be a non-empty list of distinct {list(ROLES)}"))
    socket_path: str = field(default="/tmp/kvservice.sock", metadata=declare(
        f"the workers' Unix socket (created mode 0600), 1..{MAX_SOCKET_PATH} bytes"))
    shm_name: str = field(default="kvservice", metadata=declare("name of the shared KV pool segment, under /dev/shm"))
    max_clients: int = field(default=64, metadata=declare(
        "workers connected at once", above=0, says="must be a positive int"))
    max_frame_bytes: int = field(default=4 * 1024 * 1024, metadata=declare(
        "largest frame a worker may send", lo=64 * 1024))
    ready_file: str | None = field(default=None, metadata=declare("where to write the ready line (JSON) once serving"))
    loop: Loop = field(default="auto", metadata=declare("the event loop: uvloop when installed (auto), or as named"))
    #: root only if listed
    allowed_uids: tuple[int, ...] = field(default=(), metadata=declare(
        "uids besides the daemon's own that may connect (SO_PEERCRED)", lo=0, hi=MAX_ID))
    #: so that workers of ``allowed_uids`` in it can use them
    group: str | None = field(default=None, metadata=declare(
        "group (name or gid) given read-write access to the socket and the segment (mode 0660 instead of 0600)"))

    def __post_init__(self) -> None:
        check_fields(self)
        # what a type cannot say: distinct roles, a length in bytes, a name on this host
        if not self.roles or len(set(self.roles)) != len(self.roles):
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


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """``[http]``: /healthz, /readyz, /metrics."""

    host: str = field(default="127.0.0.1", metadata=declare("interface of /healthz, /readyz and /metrics"))
    port: int = field(default=9400, metadata=declare(
        "their port; 0 picks a free one (reported in the ready line)", lo=0, hi=65535))

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.host:
            raise ConfigError("host: must not be empty")


@dataclass(frozen=True, slots=True)
class LogSettings:
    """``[log]``: the entry point's log output on stderr."""

    level: LogLevel = field(default="info", metadata=declare("the least severe event written"))
    format: LogFormat = field(default="auto", metadata=declare("auto: console on a terminal, JSON lines otherwise"))

    def __post_init__(self) -> None:
        check_fields(self)


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


#: TOML section -> the type it maps onto
SECTIONS: dict[str, type[Any]] = {
    "sidecar": DaemonSettings,
    "http": HttpSettings,
    "log": LogSettings,
    "service": ServiceConfig,
    "layout": KVLayout,
}
NOT_KEYS = {"service": {"layout"}}  # set through another section
#: ``KVLayout`` (the memory plane's type) declares its fields without docs: theirs
LAYOUT_DOCS = {
    "layers": "transformer layers; each has a K and a V plane",
    "page_tokens": "tokens per page (the engine's block size)",
    "kv_heads": "KV heads per layer (on this rank)",
    "head_dim": "elements per head",
    "dtype": "element type: " + ", ".join(sorted(DTYPE_SIZES)),
    "num_pages": "pages in the pool (need not match the peer's)",
}


def keys(section: str) -> dict[str, Any]:
    """The keys of ``section`` and their types."""
    skip = NOT_KEYS.get(section, set())
    return {name: decl.type for name, decl in declared(SECTIONS[section]).items() if name not in skip}


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
    return from_mapping(raw, os.environ if env is None else env,
                        origin=f"in {os.fspath(path)}" if path is not None else "")


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                 origin: str = "") -> SidecarConfig:
    """The configuration from ``raw`` (sections as a TOML file holds them) and ``env``'s
    ``KVSERVICE_*`` overrides; ``origin`` ("in FILE") is named with an unknown section or key."""
    values: dict[str, dict[str, Any]] = {}
    where = f" ({origin})" if origin else ""
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{shown(section)}{where}: unknown section; {suggest(section, SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: must be a table ([{section}]), got {table!r}")
        values[section] = dict(table)
    if "layout" in values.get("service", {}):
        raise ConfigError(f"service.layout{where}: not a key of [service]; the layout is its own section, [layout]")
    for section, table in values.items():
        for name, tp in keys(section).items():
            if table.get(name) == "" and _is_optional(tp):
                table[name] = None  # TOML has no null
    sources = _apply_env(values, env or {})
    try:
        layout = decode(KVLayout, values.get("layout", {}), where="layout", origin=origin)
        decoded = {section: decode(SECTIONS[section], values.get(section, {}), where=section, origin=origin)
                   for section in ("sidecar", "http", "log")}
        service = decode(ServiceConfig, values.get("service", {}), where="service", origin=origin,
                         exclude=("layout",), given={"layout": layout})
    except ConfigError as exc:
        raise ConfigError(_from_variable(str(exc), sources, env or {})) from exc
    return SidecarConfig(sidecar=decoded["sidecar"], http=decoded["http"], log=decoded["log"], service=service,
                         sources=sources)


def _apply_env(values: dict[str, dict[str, Any]], env: Mapping[str, str]) -> dict[str, str]:
    """Set ``values`` from ``env``'s variables; "section.key" -> the variable that set it."""
    sources: dict[str, str] = {}
    for var, text in sorted(env.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        if var in ENV_ALIASES:
            section, _, name = ENV_ALIASES[var].partition(".")
        else:
            section, _, name = var[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS:
            _refuse_near_miss(var, section, name)
            continue
        allowed = keys(section)
        if name not in allowed:
            variables = [variable_for(section, k) for k in allowed]
            raise ConfigError(f"{var}: {section}.{name} is not a key; {suggest(var, variables)}")
        path = f"{section}.{name}"
        try:
            value = parse_text(declared(SECTIONS[section])[name], text)
        except ValueError as exc:
            raise ConfigError(f"{path} (from {var}={text!r}): {exc}") from None
        table = values.setdefault(section, {})
        if path in sources and table[name] != value:
            raise ConfigError(f"{path}: {sources[path]} and {var} disagree; set one of them")
        table[name] = value
        sources[path] = var
    return sources


def _refuse_near_miss(var: str, section: str, name: str) -> None:
    """``ConfigError`` for a variable that is a typo of a known one (its section, or an alias);
    another tool's variable passes."""
    near = difflib.get_close_matches(section, SECTIONS, n=1, cutoff=NEAR_SECTION)
    if near and name:
        raise ConfigError(f"{var}: {section} is not a section; did you mean {variable_for(near[0], name)}?")
    alias = difflib.get_close_matches(var, ENV_ALIASES, n=1, cutoff=NEAR_ALIAS)
    if alias:
        raise ConfigError(f"{var}: not a variable of kvservice; did you mean {alias[0]}?")


def variable_for(section: str, name: str) -> str:
    """The variable that sets ``section.name``."""
    return f"{ENV_PREFIX}{section.upper()}_{name.upper()}"


_KEY = re.compile(r"^(\w+)\.(\w+): ")


def _from_variable(message: str, sources: Mapping[str, str], env: Mapping[str, str]) -> str:
    """``message`` ("service.port: ...") saying which variable set the key, when one did."""
    m = _KEY.match(message)
    var = sources.get(f"{m[1]}.{m[2]}") if m else None
    if m is None or var is None:
        return message
    return f"{m[1]}.{m[2]} (from {var}={env[var]!r}): {message[m.end():]}"


def _is_optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


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
