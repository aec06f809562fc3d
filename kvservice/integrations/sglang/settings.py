"""The service's configuration on an SGLang rank: kvservice's settings over SGLang's own.

SGLang's backends bound a request's two waits with two variables of its own
(``sglang.srt.environ.envs``, 300 s each by default): the prefill's wait for the
decode's KV indices (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``) and the decode's wait
for the KV after bootstrapping (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``).  They mean
kvservice's ``bootstrap_timeout_s`` and ``arrival_timeout_s``, so an SGLang deployment
that tuned them keeps its tuning; kvservice's own setting (the ``KVSERVICE_CONFIG``
file's ``[service]`` key, or ``KVSERVICE_SERVICE_<KEY>``) wins only where it is set.

Every source is decoded through the keys' declarations (``kvservice._settings``): SGLang's
values are checked as the keys they stand for, and the file and the ``KVSERVICE_*``
variables as the sidecar's are (``sidecar.settings.load``), so a misspelt key or variable
is refused naming it and the nearest known one.  docs/configuration.md lists them all.

No SGLang import at module level: the mapping is tested without SGLang.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..._config import ServiceConfig
from ..._results import ConfigError
from ..._settings import declared, quote

#: SGLang's variable -> the kvservice setting it stands for
SGLANG_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "bootstrap_timeout_s",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "arrival_timeout_s",
}


def read_sglang(name: str) -> Any:
    """SGLang's value of one of its variables, read as its backends read it (its own
    parsing, its default when unset)."""
    from sglang.srt.environ import envs

    return getattr(envs, name).get()


def sglang_timeouts(read: Callable[[str], Any] = read_sglang) -> dict[str, float]:
    """SGLang's timeouts as kvservice ``[service]`` settings; ``ConfigError`` naming
    SGLang's variable when a value cannot be one."""
    keys = declared(ServiceConfig)
    values: dict[str, float] = {}
    for name, key in SGLANG_TIMEOUTS.items():
        value = read(name)
        try:
            values[key] = keys[key].check(value)  # as the key is declared: a number of seconds > 0
        except ConfigError as exc:
            raise ConfigError(f"{name}={quote(value)}: the kvservice backend takes it as its {exc}") from None
    return values


def service_config(aux_row_bytes: int, *, env: Mapping[str, str] | None = None,
                   read: Callable[[str], Any] = read_sglang) -> ServiceConfig:
    """The service's configuration: the file named by ``KVSERVICE_CONFIG`` (the sidecar's
    TOML format; only ``[service]`` is used) with ``KVSERVICE_SERVICE_*`` overrides, over
    SGLang's timeouts; its payload bound raised to hold one aux row."""
    from ...sidecar.settings import load

    env = os.environ if env is None else env
    config = load(env.get("KVSERVICE_CONFIG") or None, env, defaults={"service": sglang_timeouts(read)}).service
    if aux_row_bytes > config.max_payload_bytes:
        config = config.replace(max_payload_bytes=aux_row_bytes)
    return config
