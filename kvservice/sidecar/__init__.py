"""The sidecar: ``kvservice serve`` owns one ``TransferService`` next to the
workers, who reach it over a Unix socket with ``SidecarClient`` and share its
KV pool through named shared memory.  See docs/sidecar.md.

Modules: ``settings`` (TOML + environment config), ``shm`` (the shared pool),
``wire`` (frames), ``frames`` (their reading and writing on the socket), ``server`` and
``connection`` (the workers' socket: admission, one connection per worker), ``calls`` (what
workers ask of the service), ``owners`` (whose request ids), ``client``, ``link``, ``dial``,
``handle`` and ``status`` (``SidecarClient``), ``http`` and ``metrics`` (operations
endpoints), ``daemon`` (the lifecycle), ``local`` (daemons started as child processes: the
examples, tests and benchmark use it).
"""

from .client import SidecarClient
from .handle import SidecarHandle
from .owners import NotOwnerError
from .settings import SidecarConfig
from .status import SidecarStatus
from .wire import SidecarRemoteError

__all__ = ["NotOwnerError", "SidecarClient", "SidecarConfig", "SidecarHandle", "SidecarRemoteError", "SidecarStatus"]
