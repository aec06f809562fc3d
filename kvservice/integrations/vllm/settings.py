"""``kv_connector_extra_config``: the connector's settings, decoded through kvservice's
declarations (``kvservice._settings``), so that a key vLLM's JSON misspells is refused as
a file's would be::

    {"kvservice": {"host": "10.0.0.5", "port": 7100},   -> ServiceConfig (the [service] keys)
     "decode_tp_size": 2, "handoff_skew_s": 10.0}       -> Settings

An unknown key, at either level, stops the server naming it, where it is, and the nearest
known key (``kv_connector_extra_config.kvservice.prot: unknown key; did you mean port?``).
No vLLM import: tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._config import ServiceConfig
from ..._results import ConfigError
from ..._settings import check_fields, declare, decode, quote, refuse_unknown
from .params import DEFAULT_SKEW_S, MAX_LIFETIME_S

__all__ = ["EXTRA", "Settings", "settings_from"]

#: where vLLM's ``--kv-transfer-config`` holds a connector's own settings
EXTRA = "kv_connector_extra_config"
#: the object of ``ServiceConfig`` keys inside it
SERVICE = "kvservice"


@dataclass(frozen=True, slots=True)
class Settings:
    """The connector's settings: the service's, and two of the connector's own."""

    service: ServiceConfig = field(default_factory=ServiceConfig, metadata=declare(
        "ServiceConfig keys (as the sidecar's [service] table); TP rank r of data-parallel rank d listens on "
        "port + d * tp_size + r; a producer without port (or 0) uses 7100, a consumer any free port"))
    decode_tp_size: int | None = field(default=None, metadata=declare(
        "the decodes' TP size a producer sends to (none: its own); a request may name its own", lo=1,
        says="must be a positive int"))
    handoff_skew_s: float = field(default=DEFAULT_SKEW_S, metadata=declare(
        "how far apart the prefills' and decodes' clocks may be: a decode takes a hand-off until its expiry "
        "plus this", lo=0, hi=MAX_LIFETIME_S, says=f"must be seconds in 0..{MAX_LIFETIME_S}"))

    def __post_init__(self) -> None:
        check_fields(self)


#: the keys ``kv_connector_extra_config`` may hold, as written there
KEYS = (SERVICE, "decode_tp_size", "handoff_skew_s")


def settings_from(extra: Mapping[str, Any] | None) -> Settings:
    """The connector's settings from ``kv_connector_extra_config``; ``ConfigError`` names the
    key, where it is and what is wrong."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{EXTRA}: expected an object, got {quote(extra)}")
    refuse_unknown(extra, KEYS, where=EXTRA)
    service = decode(ServiceConfig, extra.get(SERVICE, {}), where=f"{EXTRA}.{SERVICE}", exclude=("layout",))
    own = {name: value for name, value in extra.items() if name != SERVICE}
    settings: Settings = decode(Settings, own, where=EXTRA, exclude=("service",), given={"service": service})
    return settings
