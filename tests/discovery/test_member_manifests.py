"""The Kubernetes manifests issue member certificates (docs/k8s/member-identity.yaml and the
decode's csi-driver volume): each certificate names one member of the sidecar's cluster in
the role it is configured for, under the name it registers as; the files the sidecar and the
engine's connector read are the ones the member-files sidecar writes; every setting named
is one kvservice declares; renewal comes before a service warns of expiry."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvservice._config import ServiceConfig
from kvservice._trust.identity import member_uri
from kvservice._trust.revocation import EXPIRY_WARNING
from kvservice.integrations.vllm.settings import settings_from

from .test_manifest import MANIFEST, MANIFESTS, member_files

yaml = pytest.importorskip("yaml")

ISSUING = MANIFESTS / "member-identity.yaml"
#: the identity settings a member needs, and the revocation list
IDENTITY_KEYS = ("identity_cert_file", "identity_key_file", "identity_ca_file", "revoked_file")


def pod() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["spec"]
    return spec


def container(name: str) -> dict[str, Any]:
    spec = pod()
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def env_of(name: str) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(name).get("env", [])}


def hours(text: str) -> float:
    match = re.fullmatch(r"(\d+)h", text)
    assert match, text
    return float(match.group(1))


def connector_config() -> dict[str, Any]:
    args = container("engine")["args"]
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def test_each_decode_pod_is_issued_a_certificate_naming_it_in_the_sidecars_cluster_and_role() -> None:
    volume = next(v for v in pod()["volumes"] if v["name"] == "member-issued")
    attrs = volume["csi"]["volumeAttributes"]
    assert volume["csi"]["driver"] == "csi.cert-manager.io"
    env = env_of("kvservice")
    name = next(e for e in container("kvservice")["env"] if e["name"] == "KVSERVICE_SERVICE_DISCOVERY_NAME")
    assert name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # the pod's name: ${POD_NAME}
    uri = attrs["csi.cert-manager.io/uri-sans"].replace("${POD_NAME}", "decode-7d9f-x2x4q")
    assert uri == member_uri(env["KVSERVICE_CLUSTER"], env["KVSERVICE_SERVICE_DISCOVERY_ROLE"], "decode-7d9f-x2x4q")
    assert attrs["csi.cert-manager.io/key-algorithm"] in ("ECDSA", "Ed25519")
    assert hours(attrs["csi.cert-manager.io/renew-before"]) * 3600 > EXPIRY_WARNING.total_seconds()
    issuer = yaml.safe_load_all(ISSUING.read_text())
    assert attrs["csi.cert-manager.io/issuer-name"] == next(issuer)["metadata"]["name"]


def test_the_secret_alternative_is_a_member_certificate_from_the_same_issuer() -> None:
    issuer, certificate = yaml.safe_load_all(ISSUING.read_text())
    assert issuer["kind"] == "Issuer" and issuer["spec"]["ca"]["secretName"]
    spec = certificate["spec"]
    assert certificate["kind"] == "Certificate" and spec["issuerRef"]["name"] == issuer["metadata"]["name"]
    (uri,) = spec["uris"]
    cluster, role, name = uri.removeprefix("kvservice://").split("/")
    assert uri == member_uri(cluster, role, name) and cluster == env_of("kvservice")["KVSERVICE_CLUSTER"]
    assert spec["privateKey"]["algorithm"] in ("Ed25519", "ECDSA") and spec["privateKey"]["encoding"] == "PKCS8"
    assert hours(spec["renewBefore"]) * 3600 > EXPIRY_WARNING.total_seconds()
    assert hours(spec["duration"]) > hours(spec["renewBefore"])


def test_the_sidecar_and_the_engine_read_the_files_member_files_writes() -> None:
    copier = container("member-files")
    assert copier["restartPolicy"] == "Always"  # a native sidecar: it copies renewals too
    script = copier["command"][-1]
    written = {m["mountPath"] for m in copier["volumeMounts"] if m["name"] == "member"}
    (target,) = written
    names = {Path(f).name for f in shlex.split(re.search(r"for f in ([^;]+);", script).group(1))}  # type: ignore[union-attr]
    assert "umask 077" in script and "mv" in script  # private, and each file replaced whole
    files = {k: v for k, v in env_of("kvservice").items() if k.endswith("_FILE") and "ETCD" not in k}
    connector = connector_config()["kv_connector_extra_config"]["kvservice"]
    for path in [*files.values(), *connector.values()]:
        if "revoked" in path:
            continue
        assert Path(path).parent == Path(target) and Path(path).name in names, path
    assert set(connector) == {"auth_key_file", *IDENTITY_KEYS}
    assert connector["revoked_file"] == env_of("kvservice")["KVSERVICE_SERVICE_REVOKED_FILE"]


def test_the_engines_connector_settings_are_kvservices_and_load_the_member(tmp_path: Path) -> None:
    connector = connector_config()
    files = member_files(tmp_path, "decode", "pod-0")
    key = tmp_path / "cluster.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    given = dict(connector["kv_connector_extra_config"]["kvservice"])
    assert set(given) <= set(ServiceConfig.__dataclass_fields__)
    given.update({"auth_key_file": str(key), **{k: files[f"KVSERVICE_SERVICE_{k.upper()}"] for k in IDENTITY_KEYS}})
    settings = settings_from({**connector["kv_connector_extra_config"], "kvservice": given})
    identity = settings.service.identity()
    assert identity is not None and identity.member.uri == "kvservice://prod/decode/pod-0"
