"""kvservice: an asyncio KV-cache transfer service over NVIDIA NIXL.

Every transfer ends as a ``TransferResult``: a decode crash, a network drop, a
hung peer or a cancelled transfer becomes ``Failed`` with a ``FailureReason``
and the original error, never an exception that takes the caller down.
"""

import types as _types
import typing as _typing

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
from .sidecar import SidecarClient

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "FailureReason",
    "KVLayout",
    "KVMemory",
    "KVPoll",
    "KVPool",
    "KVServiceError",
    "NixlUnavailable",
    "Overloaded",
    "ProtocolError",
    "ServiceConfig",
    "ServiceStatus",
    "SidecarClient",
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
    resolved there fails ``import kvservice``, loudly, rather than a later decode."""
    if isinstance(obj, type):
        own = vars(obj).get("__annotations__", {})
        if own:
            hints = _typing.get_type_hints(obj, include_extras=True)
            obj.__annotations__ = {key: hints[key] for key in own}
        obj.__module__ = __name__
    elif isinstance(obj, _types.FunctionType):
        obj.__module__ = __name__


for _name in __all__:  # __version__ is neither a class nor a function: left alone
    _say_where_to_import(globals()[_name])
del _name, _say_where_to_import
