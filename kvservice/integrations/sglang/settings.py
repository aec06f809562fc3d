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

import difflib
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..._config import ServiceConfig
from ..._results import ConfigError
from ..._settings import declared, quote

#: SGLang's variable -> the kvservice setting it stands for
SGLANG_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "bootstrap_timeout_s",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "arrival_timeout_s",
}


#: SGLang's variables a near miss of one of ``SGLANG_TIMEOUTS`` is looked for among
SGLANG_PREFIX = "SGLANG_DISAGGREGATION_"
#: how near a variable must be to one of them to be taken for a typo of it
NEAR = 0.9


def sglang_names() -> Collection[str]:
    """The variables SGLang declares (its ``envs``)."""
    from sglang.srt.environ import envs

    return frozenset(name for name in dir(type(envs)) if name.isupper())


def refuse_near_misses(env: Mapping[str, str], names: Callable[[], Collection[str]] = sglang_names) -> None:
    """``ConfigError`` for a variable that SGLang does not declare and is a near miss of one
    this backend reads (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMOUT``): SGLang would ignore it,
    and the timeout it meant would silently stay at its default."""
    suspects = [var for var in env if var.startswith(SGLANG_PREFIX) and var not in SGLANG_TIMEOUTS
                and difflib.get_close_matches(var, SGLANG_TIMEOUTS, n=1, cutoff=NEAR)]
    if not suspects:
        return
    known = names()
    for var in sorted(suspects):
        if var not in known:
            near = difflib.get_close_matches(var, SGLANG_TIMEOUTS, n=1, cutoff=NEAR)[0]
            raise ConfigError(f"{var}: not a variable of SGLang; did you mean {near} (the kvservice backend's "
                              f"{SGLANG_TIMEOUTS[near]})?")


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
                   read: Callable[[str], Any] = read_sglang,
                   names: Callable[[], Collection[str]] = sglang_names) -> ServiceConfig:
    """The service's configuration: the file named by ``KVSERVICE_CONFIG`` (the sidecar's
    TOML format; only ``[service]`` is used) with ``KVSERVICE_SERVICE_*`` overrides, over
    SGLang's timeouts; its payload bound raised to hold one aux row.  ``names``: the
    variables SGLang declares, asked for only when one set is a near miss of its timeouts."""
    from ...sidecar.settings import load

    env = os.environ if env is None else env
    refuse_near_misses(env, names)
    config = load(env.get("KVSERVICE_CONFIG") or None, env, defaults={"service": sglang_timeouts(read)}).service
    if aux_row_bytes > config.max_payload_bytes:
        config = config.replace(max_payload_bytes=aux_row_bytes)
    return config
