"""``ServiceConfig``: every knob of a ``TransferService``, validated on creation."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from ._control.addresses import is_loopback_host, is_unspecified_host
from ._peertimes import PEER_LABELS
from ._results import ConfigError
from ._settings import check_fields, declare, quote, refuse_unknown
from ._trust.identity import Identity, load_identity
from ._trust.keys import ServiceKey, load_key, resolve_key
from ._trust.revocation import RevocationWatch
from .discovery.settings import DiscoverySettings, check_discovery
from .memory._layout import KVLayout

__all__ = ["LOOPS", "ConfigError", "Loop", "ServiceConfig"]

#: the event loop an entry point runs on: uvloop when installed ("auto"), or as named
Loop = Literal["auto", "asyncio", "uvloop"]
LOOPS: tuple[Loop, ...] = get_args(Loop)
#: a name ``ucx_env`` may set
UCX_NAME = re.compile(r"^UCX_[A-Z0-9_]+$")
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
class ServiceConfig(DiscoverySettings):
    """Configuration of one ``TransferService``.

    Each key is declared once, here (or, for discovery's keys, on ``DiscoverySettings``,
    whose keys it inherits): type, default, bounds and one line of doc
    (``kvservice._settings.declare``).  Times are in seconds.  Defaults suit loopback and a LAN;
    docs/configuration.md is the reference generated from these declarations.
    """

    layout: KVLayout = field(default_factory=KVLayout, metadata=declare("the KV pool's shape (the [layout] section)"))
    host: str = field(default="127.0.0.1", metadata=declare("interface the control listener binds"))
    port: int = field(default=0, metadata=declare("the control listener's port; 0 picks a free port", lo=0, hi=65535))
    advertise_host: str | None = field(default=None, metadata=declare(
        "host peers should dial (none: host); required when binding 0.0.0.0"))
    #: off is faster here; the watchdog then drives progress every ``poll_interval_s``
    progress_thread: bool = field(default=False, metadata=declare(
        "run NIXL's progress thread (off: the watchdog drives progress)"))
    #: without ``UCX_LOG_FILE`` here or in the environment, UCX's log lines become kvservice's
    #: ``ucx.*`` events (``_nixl.native_log``); see ``ucx_environment``
    ucx_env: Mapping[str, str] = field(default_factory=dict, metadata=declare(
        "UCX_* variables applied (unless already set) before the agent is created", env=False))
    bootstrap_timeout_s: float = field(default=30.0, metadata=declare(
        "a send waits at most this long for the receiver's expect", above=0))
    transfer_timeout_s: float = field(default=60.0, metadata=declare(
        "a sent request must complete within this long of its first chunk", above=0))
    arrival_timeout_s: float = field(default=120.0, metadata=declare(
        "an expected request must arrive within this long of expect", above=0))
    connect_timeout_s: float = field(default=5.0, metadata=declare(
        "dialling a peer's control listener gives up after this long", above=0))
    heartbeat_interval_s: float = field(default=0.5, metadata=declare(
        "a linked peer is sent a heartbeat this often", above=0))
    peer_timeout_s: float = field(default=3.0, metadata=declare(
        "a peer silent this long (no frame, no heartbeat), or not taking a write this long, is lost; "
        "must exceed heartbeat_interval_s", above=0))
    poll_interval_s: float = field(default=0.0005, metadata=declare(
        "watchdog cadence while anything is in flight (a receiver holding one request, of at most "
        "64 MiB, polls every 0.1 ms, or this if finer)", above=0))
    #: idle, nothing needs NIXL driven (a peer writes only after this service's Expect, which wakes
    #: the watchdog); its waits double from 50 ms after the last work up to this while anything is
    #: held, and are this at once while nothing is (``_transfer.cadence``)
    idle_poll_interval_s: float = field(default=1.0, metadata=declare(
        "longest the watchdog sleeps while idle (its waits back off to this from 50 ms after work "
        "while requests or unsettled pages are held; with none, this at once)", above=0))
    max_posts_per_tick: int = field(default=64, metadata=declare("transfers the watchdog posts per tick", above=0))
    #: a post may copy before it returns, so this bounds how long completions wait behind later
    #: posts; a larger budget lets more asynchronous WRITEs overlap
    max_post_bytes_per_tick: int = field(default=64 * 1024 * 1024, metadata=declare(
        "bytes posted per tick (at least one chunk)", above=0))
    max_checks_per_tick: int = field(default=4096, metadata=declare(
        "transfer handles the watchdog checks per tick", above=0))
    drain_grace_s: float = field(default=5.0, metadata=declare(
        "leaving async with waits this long for in-flight work before failing it", lo=0))
    max_frame_bytes: int = field(default=4 * 1024 * 1024, metadata=declare(
        "largest control frame a peer may send", lo=64 * 1024))
    max_payload_bytes: int = field(default=16 * 1024, metadata=declare(
        "largest send(payload=), carried in the last chunk's NIXL notification", above=0))
    results_kept: int = field(default=10_000, metadata=declare(
        "finished requests remembered (late await_* calls, sticky failures)", above=0))
    agent_prefix: str = field(default="kvservice", metadata=declare(
        "the NIXL agent name's prefix: letters, digits and '-'"))
    #: the sender sends each chunk's CRC32C and this service checks its pages against them before
    #: it reports SUCCESS (``_transfer.landing``; host memory only).  Enable it once every sender
    #: runs a version that checks landings: an older one's requests fail.
    verify_landing: bool = field(default=False, metadata=declare(
        "check every request's landing against the sender's CRC32C per chunk (what expect(verify=None) means)"))

    # -- trust ---------------------------------------------------------------------------
    auth_key_file: str | None = field(default=None, metadata=declare(
        "the cluster's shared key (kvservice keygen PATH); none: on loopback, this user's own key"))
    allow_unauthenticated: bool = field(default=False, metadata=declare(
        "without auth_key_file: run with no key at all (any local user, or anyone who reaches the port, can peer); "
        "logged as a warning"))
    #: (``_trust.identity``) with these three, this service proves its own member identity on
    #: every link and checks each peer's; without them, the cluster key is its only proof
    identity_cert_file: str | None = field(default=None, metadata=declare(
        "this member's X.509 certificate, PEM, from the cluster's authority (kvservice keygen issue); "
        "needs identity_key_file and identity_ca_file"))
    identity_key_file: str | None = field(default=None, metadata=declare(
        "this member's private key, PEM, unencrypted, mode 0600"))
    identity_ca_file: str | None = field(default=None, metadata=declare(
        "the cluster's CA certificate, PEM: peers' certificates must be issued by it"))
    allow_peers_without_identity: bool = field(default=False, metadata=declare(
        "with an identity: still link with peers that prove none (while a fleet moves to identities); "
        "such links carry no member"))
    #: (``_trust.revocation``) polled every few seconds: a member it revokes is refused, its links closed
    revoked_file: str | None = field(default=None, metadata=declare(
        "with an identity: the cluster's revocation list, a CRL signed by identity_ca_file (kvservice keygen "
        "revoke); re-read when it changes"))

    # -- bounds: each one refuses or drops, and counts (status()["refused"]) ----------
    #: (``_control.preauth``) a source past its share is refused; when all are held, a source
    #: holding fewer than the heaviest takes that one's oldest slot, else it is refused
    max_handshakes: int = field(default=64, metadata=declare(
        "connections accepted and still in their handshake", above=0))
    max_handshakes_per_source: int = field(default=16, metadata=declare(
        "such connections from one source: an IPv4 address, an IPv6 /64, the loopback addresses but "
        "127.0.0.1 together", above=0))
    #: shared bounds are charged per source as well as per peer: an agent's name costs a key
    #: holder nothing to mint, an address it connects from does
    max_peers: int = field(default=1024, metadata=declare(
        "peers linked at once; a handshake beyond it is rejected", above=0))
    max_peers_per_source: int = field(default=256, metadata=declare("peers linked at once from one source IP", above=0))
    max_outbox_bytes: int = field(default=16 * 1024 * 1024, metadata=declare(
        "frames queued for one peer; a peer that does not read past this is dropped as lost", above=0))
    max_unknown_expects: int = field(default=10_000, metadata=declare(
        "Expects per peer for requests this side has not sent yet; more are refused", above=0))
    unknown_expect_ttl_s: float = field(default=120.0, metadata=declare(
        "such an Expect with no send() this long is dropped (the receiver is told TIMEOUT)", above=0))
    #: 4 bytes each held: 16 MiB and 64 MiB
    max_unknown_expect_pages: int = field(default=1 << 22, metadata=declare(
        "pages named by such Expects, per peer", above=0))
    max_unknown_expect_pages_total: int = field(default=1 << 24, metadata=declare(
        "pages named by such Expects, all peers together", above=0))
    max_unknown_expects_per_source: int = field(default=40_000, metadata=declare(
        "such Expects from all peers of one source IP", above=0))
    max_unknown_expect_pages_per_source: int = field(default=1 << 22, metadata=declare(
        "their pages from all peers of one source IP", above=0))
    max_live_requests: int = field(default=100_000, metadata=declare(
        "requests alive at once (both sides); send()/expect() beyond it raise Overloaded", above=0))

    # -- metrics -----------------------------------------------------------------------
    metrics_peer_labels: int = field(default=PEER_LABELS, metadata=declare(
        "peers with series of their own in the per-peer histograms; later ones share peer=\"other\"",
        lo=0, hi=MAX_PEER_LABELS, says=f"must be a whole number 0..{MAX_PEER_LABELS} "
                                        "(0: every peer under peer=\"other\")"))

    # -- staging (kvservice/_transfer/staging.py) ----------------------------------------
    staging_bytes: int = field(default=256 * 1024 * 1024, metadata=declare(
        "buffer a sender gathers sliced token-major pages through (DRAM, registered once); 0: no staging",
        lo=0, hi=MAX_STAGING_BYTES, says=f"must be an int in 0..{MAX_STAGING_BYTES} (0: no staging)"))

    def __post_init__(self) -> None:
        check_fields(self)  # every key's type and bounds, as declared
        check_discovery(self)
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"peer_timeout_s: must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.peer_timeout_s!r}"
            )
        if not self.agent_prefix or not self.agent_prefix.replace("-", "").isalnum():
            raise ConfigError(
                f"agent_prefix: letters, digits and '-' only, got {self.agent_prefix!r}"
            )
        for name in self.ucx_env:
            if not UCX_NAME.match(name):
                guess = name.upper() if name.upper().startswith("UCX_") else f"UCX_{name.upper()}"
                raise ConfigError(f"ucx_env: {quote(name)} is not a UCX variable (UCX_...); "
                                  f"did you mean {quote(guess) if UCX_NAME.match(guess) else 'UCX_...'}?")
        self._check_trust()

    def _check_trust(self) -> None:
        if self.auth_key_file is not None:
            if not isinstance(self.auth_key_file, str) or not self.auth_key_file:
                raise ConfigError(f"auth_key_file: must be a path, got {self.auth_key_file!r}")
            load_key(self.auth_key_file)  # raises naming the problem (missing, readable by others, short)
        identity = self.identity()  # raises naming the problem (a file missing, not issued by the CA, expired)
        if self.revoked_file is not None:
            if identity is None:
                raise ConfigError("revoked_file: a revocation list is of member certificates; it needs this "
                                  "service's identity (identity_cert_file, identity_key_file, identity_ca_file)")
            RevocationWatch(self.revoked_file, identity.ca)  # raises: unreadable, garbage, not the CA's
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
        return DiscoverySettings(**{name: getattr(self, name) for name in DISCOVERY_KEYS})

    @property
    def ucx_environment(self) -> dict[str, str]:
        """What the agent starts with: ``ucx_env`` over this host's ``host_ucx_defaults``
        (a variable already set in the process's environment wins over all)."""
        return {**host_ucx_defaults(), **self.ucx_env}

    def resolve_key(self) -> ServiceKey:
        """The key this service authenticates with; may create this user's key (file I/O)."""
        return resolve_key(self.auth_key_file, allow_unauthenticated=self.allow_unauthenticated,
                           loopback=self.loopback_only)

    def identity(self) -> Identity | None:
        """This service's member identity, loaded and checked (file I/O); ``None`` without one."""
        files = (self.identity_cert_file, self.identity_key_file, self.identity_ca_file)
        if all(f is None for f in files):
            return None
        if any(f is None for f in files):
            raise ConfigError("identity_cert_file, identity_key_file and identity_ca_file: set all three or none")
        if self.allow_unauthenticated and self.auth_key_file is None:
            raise ConfigError("identity_cert_file: a member identity is proven on keyed links; it needs a key "
                              "(auth_key_file, or this user's key on loopback), not allow_unauthenticated")
        return load_identity(*cast(tuple[str, str, str], files), role=self.discovery_role)

    @property
    def agent_base(self) -> str:
        """What this service's agent names start with: its member name with an identity
        (peers check that: ``_trust.identity.agent_of``), else ``agent_prefix``."""
        if self.identity_cert_file is None:
            return self.agent_prefix
        identity = self.identity()
        return identity.member.name if identity is not None else self.agent_prefix

    @property
    def loopback_only(self) -> bool:
        """Whether only this host can reach the control listener."""
        return is_loopback_host(self.host)

    def replace(self, **changes: Any) -> ServiceConfig:
        return dataclasses.replace(self, **changes)


def _refusing_unknown_keywords(cls: type[Any]) -> None:
    """Make ``cls(misspelt=...)`` (and so ``replace``) the refusal every other source gives,
    a ``ConfigError`` naming the key and the nearest known one, not the bare ``TypeError``
    a dataclass's ``__init__`` raises."""
    init = cls.__init__
    keys = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse_unknown(kwargs, keys, where=cls.__name__)
        init(self, *args, **kwargs)

    cls.__init__ = __init__


_refusing_unknown_keywords(ServiceConfig)
