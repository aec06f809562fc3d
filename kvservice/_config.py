"""``ServiceConfig``: every knob of a ``TransferService``, validated on creation."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._control.addresses import is_loopback_host, is_unspecified_host
from ._peertimes import PEER_LABELS
from ._results import ConfigError
from ._trust.keys import ServiceKey, load_key, resolve_key
from .discovery.settings import DiscoveryKind, DiscoverySettings, Unreachable
from .memory._layout import KVLayout

__all__ = ["LOOPS", "ConfigError", "ServiceConfig"]

LOOPS = ("auto", "asyncio", "uvloop")
#: the most ``metrics_peer_labels`` may be: each label costs ~60 series in ``/metrics``
MAX_PEER_LABELS = 1024
#: the keys ``ServiceConfig`` holds for discovery, each as ``DiscoverySettings`` names it
DISCOVERY_KEYS = tuple(f.name for f in dataclasses.fields(DiscoverySettings))
#: the largest staging buffer (64 GiB): past it, a typo
MAX_STAGING_BYTES = 1 << 36

#: where Linux lists RDMA devices (InfiniBand, RoCE, EFA)
RDMA_DEVICES = "/sys/class/infiniband"
#: UCX's modules that drive RDMA devices, left unloaded on a host that has none
#: (``host_ucx_defaults``)
UCX_RDMA_MODULES = "^ib,ib_mlx5,ib_efa,ib_mlx5_gda,rdmacm"


@functools.cache
def host_ucx_defaults() -> Mapping[str, str]:
    """UCX settings this host needs, applied unless ``ucx_env`` or the process's
    environment sets them.

    On a host with ``libibverbs`` installed but no RDMA device (a cloud VM with
    rdma-core, a container built from a GPU image), UCX loads its InfiniBand
    module, finds nothing, and leaves the ``libnl-route`` it pulled in to crash in
    its destructor when the process exits: every process that created a NIXL
    agent then ends with SIGSEGV (exit code -11 / 139) after a clean shutdown.
    Without a device those modules have nothing to drive, so they are not loaded
    (``UCX_MODULES``); a host with RDMA devices keeps UCX's default."""
    try:
        with os.scandir(RDMA_DEVICES) as entries:
            if any(True for _ in entries):
                return {}
    except OSError:
        pass
    return {"UCX_MODULES": UCX_RDMA_MODULES}


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Configuration of one ``TransferService``.

    Times are in seconds.  Defaults suit loopback and a LAN; see the README's
    configuration table for what each one trades off.
    """

    layout: KVLayout = field(default_factory=KVLayout)
    #: interface the control listener binds; port 0 picks a free port
    host: str = "127.0.0.1"
    port: int = 0
    #: host peers should dial (defaults to ``host``; set it when binding 0.0.0.0)
    advertise_host: str | None = None
    #: NIXL progress thread.  Off is faster here (see README); the watchdog then
    #: drives progress by calling into NIXL every ``poll_interval_s``.
    progress_thread: bool = False
    #: UCX environment applied (if not already set) before the agent is created (see
    #: ``ucx_environment``).  Without ``UCX_LOG_FILE`` here or in the environment, UCX's
    #: log lines become kvservice's ``ucx.*`` events (``_nixl.native_log``).
    ucx_env: Mapping[str, str] = field(default_factory=dict)
    #: a send waits at most this long for the receiver's ``expect``
    bootstrap_timeout_s: float = 30.0
    #: a sent request must complete within this long of its first chunk
    transfer_timeout_s: float = 60.0
    #: an expected request must arrive within this long of ``expect``
    arrival_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    heartbeat_interval_s: float = 0.5
    #: a peer silent this long (no frame, no heartbeat) is lost
    peer_timeout_s: float = 3.0
    #: watchdog cadence while anything is in flight / while idle
    poll_interval_s: float = 0.0005
    idle_poll_interval_s: float = 0.05
    max_posts_per_tick: int = 64
    #: bytes posted per tick (at least one chunk).  A post may copy before it
    #: returns, so this bounds how long completions wait behind later posts; a
    #: larger budget lets more asynchronous WRITEs overlap (see README).
    max_post_bytes_per_tick: int = 64 * 1024 * 1024
    max_checks_per_tick: int = 4096
    #: ``async with`` exit waits this long for in-flight work before failing it
    drain_grace_s: float = 5.0
    max_frame_bytes: int = 4 * 1024 * 1024
    #: a request's ``send(payload=)``, travelling in its last chunk's NIXL notification
    max_payload_bytes: int = 16 * 1024
    #: finished requests remembered (for late ``await_*`` calls and sticky failures)
    results_kept: int = 10_000
    agent_prefix: str = "kvservice"
    #: receiving side: check every request's landing (``expect(verify=None)`` means this):
    #: the sender sends each chunk's CRC32C and this service checks its pages against them
    #: before it reports SUCCESS (``_transfer.landing``; host memory only).  Enable it once
    #: every sender runs a version that checks landings: an older one's requests fail.
    verify_landing: bool = False

    # -- trust (README "Security") ---------------------------------------------------
    #: the cluster's shared key (``kvservice keygen PATH``); None: on loopback, this
    #: user's own key (created on first use, see ``_trust.keys.resolve_key``)
    auth_key_file: str | None = None
    #: without ``auth_key_file``: run with no key at all, on loopback too (any local user
    #: can peer) or on another address (anyone who reaches it can); logged as a warning
    allow_unauthenticated: bool = False

    # -- bounds: each one refuses or drops, and counts (status()["refused"]) ----------
    #: connections accepted and still in their handshake, in all and from one source IP
    #: (``_control.preauth``): a source past its share is refused; when all are held, a source
    #: holding fewer than the heaviest takes that one's oldest slot, else it is refused
    max_handshakes: int = 64
    max_handshakes_per_source: int = 16
    #: peers linked at once, in all and from one source IP; a handshake beyond either is rejected.
    #: Shared bounds are charged per source as well as per peer: an agent's name costs a key
    #: holder nothing to mint, an address it connects from does (a per-source bound at or above
    #: its total lets one source take all of it: one host's peers on loopback, say)
    max_peers: int = 1024
    max_peers_per_source: int = 256
    #: frames queued for one peer; a peer that does not read past this is dropped as lost
    max_outbox_bytes: int = 16 * 1024 * 1024
    #: Expects for requests this side has not sent yet, per peer; more are refused
    max_unknown_expects: int = 10_000
    #: such an Expect with no send() this long is dropped (the receiver is told TIMEOUT)
    unknown_expect_ttl_s: float = 120.0
    #: pages named by such Expects, per peer and for all peers together (4 bytes each
    #: held: 16 MiB and 64 MiB); an Expect beyond either is refused
    max_unknown_expect_pages: int = 1 << 22
    max_unknown_expect_pages_total: int = 1 << 24
    #: such Expects and their pages from all peers of one source IP together: its share of the total
    max_unknown_expects_per_source: int = 40_000
    max_unknown_expect_pages_per_source: int = 1 << 22
    #: requests alive at once (both sides); send()/expect() beyond it raise ``Overloaded``
    max_live_requests: int = 100_000

    # -- discovery (README "Discovery", docs/cluster.md) --------------------------------
    # ``DiscoverySettings``' keys, flat as the file and KVSERVICE_* hold them: what each
    # means and how it is checked is written there; ``discovery_settings`` is them as one
    discovery: DiscoveryKind = "static"
    cluster: str = "default"
    discovery_name: str | None = None
    discovery_role: str = ""
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    etcd_ttl_s: float = 10.0
    etcd_keepalive_s: float = 3.0
    etcd_rejoin_grace_s: float = 5.0
    etcd_connect_timeout_s: float = 5.0
    etcd_unreachable: Unreachable = "fail"
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_username: str | None = None
    etcd_password_file: str | None = None

    # -- metrics (README "Metrics") --------------------------------------------------------
    #: peers with series of their own in the per-peer histograms; later ones share peer="other"
    metrics_peer_labels: int = PEER_LABELS

    # -- staging (README "Tensor parallelism", kvservice/_transfer/staging.py) ------------
    #: bytes of the buffer a sender gathers sliced token-major pages through (registered
    #: once at start, DRAM, token-major pools only); 0: no staging (per-token descriptors)
    staging_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"layout: expected KVLayout, got {type(self.layout).__name__}")
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port: must be 0..65535, got {self.port!r}")
        positive = (
            "bootstrap_timeout_s", "transfer_timeout_s", "arrival_timeout_s",
            "connect_timeout_s", "heartbeat_interval_s", "peer_timeout_s",
            "poll_interval_s", "idle_poll_interval_s", "max_posts_per_tick", "max_post_bytes_per_tick",
            "max_checks_per_tick", "max_frame_bytes", "max_payload_bytes", "results_kept",
            "max_handshakes", "max_handshakes_per_source", "max_peers", "max_peers_per_source",
            "max_outbox_bytes", "max_unknown_expects", "unknown_expect_ttl_s", "max_unknown_expect_pages",
            "max_unknown_expect_pages_total", "max_unknown_expects_per_source",
            "max_unknown_expect_pages_per_source", "max_live_requests",
        )
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{key}: must be a positive number, got {value!r}")
        if not isinstance(self.verify_landing, bool):
            raise ConfigError(f"verify_landing: must be true or false, got {self.verify_landing!r}")
        if self.drain_grace_s < 0:
            raise ConfigError(f"drain_grace_s: must be >= 0, got {self.drain_grace_s!r}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"peer_timeout_s: must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.peer_timeout_s!r}"
            )
        if self.max_frame_bytes < 64 * 1024:
            raise ConfigError(f"max_frame_bytes: must be >= 65536, got {self.max_frame_bytes!r}")
        if not self.agent_prefix or not self.agent_prefix.replace("-", "").isalnum():
            raise ConfigError(
                f"agent_prefix: letters, digits and '-' only, got {self.agent_prefix!r}"
            )

        if isinstance(self.staging_bytes, bool) or not isinstance(self.staging_bytes, int) \
                or not 0 <= self.staging_bytes <= MAX_STAGING_BYTES:
            raise ConfigError(f"staging_bytes: must be an int in 0..{MAX_STAGING_BYTES} (0: no staging), "
                              f"got {self.staging_bytes!r}")
        self._check_trust()
        # raises ConfigError naming the key; a list of endpoints (JSON, a table) comes back a tuple
        object.__setattr__(self, "etcd_endpoints", self.discovery_settings.etcd_endpoints)
        labels = self.metrics_peer_labels
        if isinstance(labels, bool) or not isinstance(labels, int) or not 0 <= labels <= MAX_PEER_LABELS:
            raise ConfigError(f"metrics_peer_labels: must be a whole number 0..{MAX_PEER_LABELS} "
                              f"(0: every peer under peer=\"other\"), got {labels!r}")

    def _check_trust(self) -> None:
        if self.auth_key_file is not None:
            if not isinstance(self.auth_key_file, str) or not self.auth_key_file:
                raise ConfigError(f"auth_key_file: must be a path, got {self.auth_key_file!r}")
            load_key(self.auth_key_file)  # raises naming the problem (missing, readable by others, short)
        if is_unspecified_host(self.host) and not self.advertise_host:
            raise ConfigError(
                f"advertise_host: required when host is {self.host!r} (peers cannot dial it); "
                "set it to the address peers reach this service at")
        if self.advertise_host is not None and (
                not self.advertise_host or is_unspecified_host(self.advertise_host)):
            raise ConfigError(f"advertise_host: must be a host peers can dial, got {self.advertise_host!r}")
        if self.auth_key_file is None and not self.allow_unauthenticated and not self.loopback_only:
            raise ConfigError(
                f"auth_key_file: required when host is {self.host!r} (not loopback): without a key "
                "anyone who reaches the port can take requests' KV; set auth_key_file "
                "(kvservice keygen PATH), or allow_unauthenticated = true to accept that risk")

    @property
    def discovery_settings(self) -> DiscoverySettings:
        """This service's discovery keys as discovery's own settings (checked again on
        each call: a few comparisons and, with TLS files, a ``stat`` each)."""
        return DiscoverySettings(**{key: getattr(self, key) for key in DISCOVERY_KEYS})

    @property
    def ucx_environment(self) -> dict[str, str]:
        """What the agent starts with: ``ucx_env`` over this host's ``host_ucx_defaults``
        (a variable already set in the process's environment wins over all)."""
        return {**host_ucx_defaults(), **self.ucx_env}

    def resolve_key(self) -> ServiceKey:
        """The key this service authenticates with; may create this user's key (file I/O)."""
        return resolve_key(self.auth_key_file, allow_unauthenticated=self.allow_unauthenticated,
                           loopback=self.loopback_only)

    @property
    def loopback_only(self) -> bool:
        """Whether only this host can reach the control listener."""
        return is_loopback_host(self.host)

    def replace(self, **changes: Any) -> ServiceConfig:
        return dataclasses.replace(self, **changes)
