"""kvservice: an asyncio KV-cache transfer service over NVIDIA NIXL.

Every transfer ends as a ``TransferResult``: a decode crash, a network drop, a
hung peer or a cancelled transfer becomes ``Failed`` with a ``FailureReason``
and the original error, never an exception that takes the caller down.
"""

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
