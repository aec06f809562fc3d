"""The Kubernetes manifests in docs/k8s pass a schema check (kubernetes-validate, the
schemas of a current Kubernetes release, offline); the sidecar's sets only keys kvservice
knows, and etcd and its clients authenticate with certificates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvservice._trust.authority import CA_CERT, create_authority, issue, revoke
from kvservice.sidecar.settings import from_mapping

MANIFESTS = Path(__file__).resolve().parents[2] / "docs" / "k8s"
MANIFEST = MANIFESTS / "decode-with-sidecar.yaml"
ETCD = MANIFESTS / "etcd.yaml"
KUBERNETES = "1.33.0"


def test_manifest_passes_the_schema_check() -> None:
    try:
        import kubernetes_validate
        import yaml
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (it is in the test extra)")
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    docs = [doc for path in (MANIFEST, ETCD) for doc in yaml.safe_load_all(path.read_text())]
    assert len(docs) == 3
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
    for var in (f"KVSERVICE_SERVICE_ETCD_{f}_FILE" for f in ("CA", "CERT", "KEY")):
        env[var] = str(tmp_path / Path(env[var]).name)  # where the secret is mounted
        Path(env[var]).write_text("PEM")
    env.update(member_files(tmp_path, "decode", "pod-0"))  # what the member-files sidecar copies
    cfg = from_mapping({}, env)
    identity = cfg.service.identity()
    assert identity is not None and identity.member.uri == "kvservice://prod/decode/pod-0"
    assert all(e.startswith("https://") for e in cfg.service.etcd_endpoints)
    assert cfg.service.etcd_ca_file and cfg.service.etcd_cert_file and cfg.service.etcd_key_file
    assert (cfg.service.discovery, cfg.service.cluster, cfg.service.discovery_name) == ("etcd", "prod", "pod-0")
    assert len(cfg.service.etcd_endpoints) == 3 and cfg.service.advertise_host == "10.0.0.7"


def member_files(tmp_path: Path, role: str, name: str) -> dict[str, str]:
    """A member's files from an authority of cluster "prod", as the manifest's identity
    variables name them (and the revocation list)."""
    ca = tmp_path / "authority"
    ca.mkdir(exist_ok=True)
    create_authority(str(ca), "prod", force=True)
    cert, key = issue(str(ca), role, name, str(ca), force=True)
    return {"KVSERVICE_SERVICE_IDENTITY_CERT_FILE": cert, "KVSERVICE_SERVICE_IDENTITY_KEY_FILE": key,
            "KVSERVICE_SERVICE_IDENTITY_CA_FILE": str(ca / CA_CERT),
            "KVSERVICE_SERVICE_REVOKED_FILE": revoke(str(ca), [])[0]}


def test_etcd_admits_only_clients_with_a_certificate() -> None:
    """The etcd the sidecars use refuses clients (and members) without a certificate its CA
    signed, and speaks only TLS; the sidecar's endpoints point at those names."""
    yaml = pytest.importorskip("yaml")
    service, statefulset = yaml.safe_load_all(ETCD.read_text())
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--"))
    assert flags["--client-cert-auth"] == "true" and flags["--peer-client-cert-auth"] == "true"
    assert flags["--trusted-ca-file"] and flags["--peer-trusted-ca-file"]
    for key in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls", "--initial-cluster"):
        assert "http://" not in flags[key] and "https://" in flags[key], key
    sidecar = next(c for c in yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["spec"]["containers"]
                   if c["name"] == "kvservice")
    endpoints = next(e["value"] for e in sidecar["env"] if e["name"] == "KVSERVICE_ETCD_ENDPOINTS")
    members = [f"https://etcd-{i}.{service['metadata']['name']}:2379" for i in range(statefulset["spec"]["replicas"])]
    assert endpoints.split(",") == members
