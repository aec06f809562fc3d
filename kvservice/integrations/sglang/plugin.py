"""The SGLang plugin: ``--disaggregation-transfer-backend kvservice`` without patching SGLang.

SGLang loads the entry-point group ``sglang.srt.plugins`` (filtered by ``SGLANG_PLUGINS``)
in every process before it parses arguments or builds a scheduler, runs each plugin's
function, then applies the hooks they registered (``HookRegistry.apply_hooks``).  A
transfer backend is chosen in three places, and ``register`` reaches each through that
route:

1. the CLI choice: ``add_disagg_transfer_backend_choices(["kvservice"])``;
2. ``TransferBackend(server_args.disaggregation_transfer_backend)``, a closed ``Enum``
   that the scheduler, the tokenizer manager and ``start_disagg_service`` construct:
   replaced (``HookType.REPLACE``) by an enum with the same members plus ``KVSERVICE``.
   HookRegistry rebinds every module that imported the name, so comparisons such as
   ``transfer_backend == TransferBackend.NIXL`` keep working;
3. ``get_kv_class(backend, class_type)``, the factory: wrapped (``HookType.AROUND``) so
   that ``KVSERVICE`` gives this package's classes and every other backend SGLang's.

The entry point is declared by an installed distribution (``sglang.srt.plugins``:
``kvservice = kvservice.integrations.sglang.plugin:register``; docs/sglang.md).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

BACKEND = "kvservice"
UTILS = "sglang.srt.disaggregation.utils"


@functools.cache
def transfer_backend_enum() -> type[enum.Enum]:
    """SGLang's ``TransferBackend`` with ``KVSERVICE`` added (built once: one class for good)."""
    from sglang.srt.disaggregation import utils

    original: type[enum.Enum] = utils.TransferBackend
    if any(m.value == BACKEND for m in original):
        return original
    members = [(m.name, m.value) for m in original] + [(BACKEND.upper(), BACKEND)]
    extended = enum.Enum(original.__name__, members, module=original.__module__,  # type: ignore[misc]
                         qualname=original.__qualname__)
    extended.__doc__ = original.__doc__
    return extended


def get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's ``get_kv_class`` for every backend but ``kvservice``."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from . import conn

    classes = {"manager": conn.KVManager, "sender": conn.KVSender, "receiver": conn.KVReceiver,
               "bootstrap_server": conn.KVBootstrapServer}
    kind = getattr(class_type, "value", class_type)
    if kind == "kvargs":
        return original(transfer_backend, class_type)  # SGLang's KVArgs, shared by every backend
    return classes.get(kind)


def register() -> None:
    """The plugin's entry point: called by SGLang's ``load_plugins()`` in each process."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(f"{UTILS}.TransferBackend", transfer_backend_enum(), HookType.REPLACE)
    HookRegistry.register(f"{UTILS}.get_kv_class", get_kv_class, HookType.AROUND)
