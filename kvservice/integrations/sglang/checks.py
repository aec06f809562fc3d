"""Every value SGLang hands the backend, checked where it arrives (``conn``).

The room and the bootstrap address come from a client's request body; the DP rank, the
page indices and the aux index from SGLang's schedulers.  Each check raises
``ValueError`` naming the value (shown short: a hostile value must not make a long log
line); ``conn`` turns it into a Failed request (``REFUSED``), never an exception in a
scheduler's loop.  Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._control.addresses import split_address
from ...memory._layout import PageIndex, check_pages

#: what an entry may raise on a value SGLang handed over (``int(None)``, ``len()`` of a scalar,
#: ``int(float("inf"))``, the facade's refusals...): each becomes a Failed request, never an
#: exception in a scheduler's loop
BAD_INPUT = (ValueError, TypeError, OverflowError, RuntimeError)
#: rooms are SGLang's 64-bit request keys (a client may send its own)
MAX_ROOM = 2**64 - 1


def show(value: Any) -> str:
    """``repr(value)``, cut short: a hostile value must not make a long log line."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr() of a huge int can raise
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile object's own __repr__
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:77]}..."


def request_id(room: Any) -> str:
    if not isinstance(room, (int, np.integer)) or isinstance(room, (bool, np.bool_)) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be an int in 0..2**64-1, got {show(room)}")
    return str(int(room))


def bootstrap_addr(addr: Any) -> str:
    """``addr`` if it is a bootstrap address (``host:port``); ``ValueError`` saying why not."""
    try:
        split_address(addr)
    except ValueError:
        raise ValueError(f"bootstrap_addr must be 'host:port', got {show(addr)}") from None
    return str(addr)


def index(name: str, value: Any, bound: int, low: int = 0) -> int:
    """``value`` as an int in ``low..bound-1``; ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or not low <= value < bound:
        raise ValueError(f"{name} must be an int in {low}..{bound - 1}, got {show(value)}")
    return int(value)


def pages(kv_indices: Any, num_pages: int) -> PageIndex:
    """``kv_indices`` as page indices of this rank's pool, checked now (the service would
    refuse them later, after the call returned); ``ValueError`` naming what is wrong."""
    try:
        return check_pages(np.asarray(kv_indices), num_pages)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"kv_indices {show(kv_indices)}: {exc}") from None
