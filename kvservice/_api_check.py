"""Both faces of the API satisfy ``KVTransfer`` (``kvservice/_api.py``): mypy checks these
assignments on every run, so a parameter renamed, added or dropped on one face, or a
method made a coroutine on one and not the other, fails the type check.  Nothing
imports this module; it holds no behaviour."""

from __future__ import annotations

from ._api import KVTransfer
from ._service import TransferService
from ._transfer.requests import TransferHandle
from .sidecar.client import SidecarClient
from .sidecar.handle import SidecarHandle


def in_process(svc: TransferService) -> KVTransfer[TransferHandle]:
    return svc


def through_the_sidecar(client: SidecarClient) -> KVTransfer[SidecarHandle]:
    return client
