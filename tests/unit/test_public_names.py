"""Public names say where to import them: what ``kvservice`` exports prints as
``kvservice.X``, pickles by that name, and still reads its own annotations."""

from __future__ import annotations

import pickle
import traceback
import types
import typing
from pathlib import Path

import kvservice
from kvservice import FailureReason, TransferFailed, TransferResult, TransferStatus
from kvservice.sidecar.settings import load

CONFIG = Path(__file__).resolve().parents[2] / "config"

EXPORTED = [getattr(kvservice, name) for name in kvservice.__all__]
CLASSES = [obj for obj in EXPORTED if isinstance(obj, type)]


def test_exported_classes_and_functions_say_kvservice() -> None:
    named = [obj for obj in EXPORTED if isinstance(obj, type | types.FunctionType)]
    assert len(named) == len(kvservice.__all__) - 1  # all but __version__
    assert {obj.__qualname__: obj.__module__ for obj in named} == {obj.__qualname__: "kvservice" for obj in named}
    assert repr(kvservice.TransferResult) == "<class 'kvservice.TransferResult'>"
    assert repr(kvservice.freeze_startup_objects).startswith("<function freeze_startup_objects at ")
    assert kvservice.__version__ == "0.1.0"


def test_a_traceback_names_the_exception_where_it_is_imported_from() -> None:
    exc = TransferFailed("r1", FailureReason.TIMEOUT, "no arrival within 5s")
    assert traceback.format_exception_only(exc) == [
        "kvservice.TransferFailed: request 'r1' failed TIMEOUT (no peer known yet): no arrival within 5s\n"]


def test_a_failed_result_and_its_exception_round_trip_through_pickle() -> None:
    result = TransferResult("r1", TransferStatus.FAILED, FailureReason.PEER_LOST, message="lost peer",
                            created_at=1.0, finished_at=2.5, settled=True)
    with_error = TransferResult("r2", TransferStatus.FAILED, FailureReason.TIMEOUT,
                                error=TransferFailed("r2", FailureReason.TIMEOUT, "no arrival"), message="no arrival")
    assert b"ckvservice\nTransferResult\n" in pickle.dumps(result, protocol=0)  # found by its public name
    again, again_error = pickle.loads(pickle.dumps([result, with_error]))
    assert again == result and again.reason is FailureReason.PEER_LOST and again.poll is result.poll
    assert isinstance(again_error.error, TransferFailed)
    assert (again_error.error.request_id, again_error.error.reason, str(again_error.error)) == (
        "r2", FailureReason.TIMEOUT, "request 'r2' failed TIMEOUT (no peer known yet): no arrival")


def test_exported_classes_still_resolve_their_annotations() -> None:
    """``typing.get_type_hints`` reads string annotations in the namespace that
    ``__module__`` names: renaming it must not leave them unresolvable."""
    for cls in CLASSES:
        typing.get_type_hints(cls, include_extras=True)
    assert typing.get_type_hints(TransferResult)["payload"] == bytes | None


def test_a_config_file_still_decodes_into_the_exported_config() -> None:
    """msgspec decodes ``[service]`` and ``[layout]`` into ``ServiceConfig`` and ``KVLayout``
    by their annotations."""
    cfg = load(CONFIG / "prefill.toml", env={})
    assert isinstance(cfg.service, kvservice.ServiceConfig) and isinstance(cfg.layout, kvservice.KVLayout)


def test_the_lazy_names_the_typed_imports_and_all_agree() -> None:
    """``kvservice/__init__`` names each public name three times: in ``__all__``, in the
    imports mypy reads (under ``TYPE_CHECKING``) and in ``_WHERE``, what the interpreter
    imports on first use.  They must name the same objects from the same modules."""
    import ast

    tree = ast.parse(Path(kvservice.__file__).read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed |= {alias.name: "." * imp.level + (imp.module or "") for alias in imp.names}
    where = kvservice._WHERE
    assert typed == where
    assert sorted(kvservice.__all__) == sorted([*where, "__version__"])
    assert set(dir(kvservice)) >= set(kvservice.__all__)


def test_import_kvservice_alone_loads_neither_torch_nor_nixl_and_a_public_name_loads_them_all() -> None:
    import json
    import subprocess
    import sys

    probe = ("import json, sys, kvservice\n"
             "before = [m for m in ('torch', 'nixl', 'kvservice._service') if m in sys.modules]\n"
             "from kvservice import KVPoll\n"
             "print(json.dumps([before, kvservice.TransferService.__module__, 'kvservice._service' in sys.modules,"
             " repr(kvservice.SidecarStatus)]))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                          cwd=CONFIG.parent)
    assert json.loads(done.stdout) == [[], "kvservice", True, "<class 'kvservice.SidecarStatus'>"]
