"""The Kubernetes manifest in docs/k8s passes a schema check (kubernetes-validate, the
schemas of a current Kubernetes release, offline) and sets only keys kvservice knows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvservice.sidecar.settings import from_mapping

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "k8s" / "decode-with-sidecar.yaml"
KUBERNETES = "1.33.0"


def test_manifest_passes_the_schema_check() -> None:
    try:
        import kubernetes_validate
        import yaml
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (it is in the test extra)")
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        broken = {**docs[0], "spec": {**docs[0]["spec"], "replicas": "eight"}}
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_sidecars_environment_is_a_valid_config(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(MANIFEST.read_text())
    sidecar = next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "kvservice")
    key = tmp_path / "cluster.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    env = {e["name"]: e.get("value", "pod-0" if "NAME" in e["name"] else "10.0.0.7") for e in sidecar["env"]}
    env["KVSERVICE_AUTH_KEY_FILE"] = str(key)
    env["KVSERVICE_SIDECAR_SOCKET_PATH"] = str(tmp_path / "kv.sock")
    cfg = from_mapping({}, env)
    assert (cfg.service.discovery, cfg.service.cluster, cfg.service.discovery_name) == ("etcd", "prod", "pod-0")
    assert len(cfg.service.etcd_endpoints) == 3 and cfg.service.advertise_host == "10.0.0.7"
