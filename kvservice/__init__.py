"""kvservice: an asyncio KV-cache transfer service over NVIDIA NIXL.

Every transfer ends as a ``TransferResult``: a decode crash, a network drop, a
hung peer or a cancelled transfer becomes ``Failed`` with a ``FailureReason``
and the original error, never an exception that takes the caller down.

The public names load on first use (``from kvservice import TransferService``, or
``kvservice.TransferService``): ``import kvservice`` alone, and so ``kvservice --help``
and ``kvservice --version``, imports neither torch nor NIXL.
"""

from __future__ import annotations

import importlib as _importlib
import types as _types
import typing as _typing

__version__ = "0.1.0"

if _typing.TYPE_CHECKING:
    from ._api import KVTransfer
    from ._config import ServiceConfig
    from ._results import (
        AuthenticationError,
        ConfigError,
        FailureReason,
        KVPoll,
        KVServiceError,
        NixlUnavailable,
        Overloaded,
        ProtocolError,
        TransferFailed,
        TransferResult,
        TransferStatus,
        UnknownRequestError,
    )
    from ._runtime import freeze_startup_objects
    from ._service import TransferService
    from ._stats import ServiceStatus
    from ._tp import TensorParallel
    from ._transfer.requests import TransferHandle
    from .memory import KVMemory
    from .memory._layout import KVLayout
    from .memory._pool import KVPool
    from .sidecar import SidecarClient, SidecarStatus

#: each public name and the module that defines it: the imports above, for the interpreter
#: (tests/unit/test_public_names.py checks that these, the imports and ``__all__`` agree)
_WHERE: dict[str, str] = {
    "AuthenticationError": "._results",
    "ConfigError": "._results",
    "FailureReason": "._results",
    "KVLayout": ".memory._layout",
    "KVMemory": ".memory",
    "KVPoll": "._results",
    "KVPool": ".memory._pool",
    "KVServiceError": "._results",
    "KVTransfer": "._api",
    "NixlUnavailable": "._results",
    "Overloaded": "._results",
    "ProtocolError": "._results",
    "ServiceConfig": "._config",
    "ServiceStatus": "._stats",
    "SidecarClient": ".sidecar",
    "SidecarStatus": ".sidecar",
    "TensorParallel": "._tp",
    "TransferFailed": "._results",
    "TransferHandle": "._transfer.requests",
    "TransferResult": "._results",
    "TransferService": "._service",
    "TransferStatus": "._results",
    "UnknownRequestError": "._results",
    "freeze_startup_objects": "._runtime",
}

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "FailureReason",
    "KVLayout",
    "KVMemory",
    "KVPoll",
    "KVPool",
    "KVServiceError",
    "KVTransfer",
    "NixlUnavailable",
    "Overloaded",
    "ProtocolError",
    "ServiceConfig",
    "ServiceStatus",
    "SidecarClient",
    "SidecarStatus",
    "TensorParallel",
    "TransferFailed",
    "TransferHandle",
    "TransferResult",
    "TransferService",
    "TransferStatus",
    "UnknownRequestError",
    "__version__",
    "freeze_startup_objects",
]


def _say_where_to_import(obj: object) -> None:
    """Public names say where to import them: ``kvservice.TransferResult`` in reprs,
    tracebacks and pickles (pickle finds a class by ``__module__`` and ``__qualname__``,
    and this module exports it).

    ``typing.get_type_hints`` and msgspec (decoding a ``ServiceConfig`` from a file)
    read a class's string annotations in the namespace its ``__module__`` names, so a
    class's own are resolved first, where they were written; one that cannot be
    resolved there fails loudly here rather than a later decode."""
    if isinstance(obj, type):
        own = vars(obj).get("__annotations__", {})
        if own:
            hints = _typing.get_type_hints(obj, include_extras=True)
            obj.__annotations__ = {key: hints[key] for key in own}
        obj.__module__ = __name__
    elif isinstance(obj, _types.FunctionType):
        obj.__module__ = __name__


def _load() -> None:
    """Import every public name at once (the first one asked for brings them all, so they
    all say ``kvservice`` from then on) and keep them here: ``__getattr__`` is not asked again."""
    found = {name: getattr(_importlib.import_module(module, __name__), name) for name, module in _WHERE.items()}
    for obj in found.values():
        _say_where_to_import(obj)
    globals().update(found)


def __getattr__(name: str) -> object:
    if name in _WHERE:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
