# The kvservice sidecar: `kvservice serve` next to prefill or decode workers.
#
#   docker build -t kvservice-sidecar .
#   kvservice keygen cluster.key && sudo chown 10001 cluster.key     # once per cluster
#   docker run -d --name kv-prefill --network host --ipc shareable \
#       -v "$PWD/config:/etc/kvservice:ro" -v kvservice-run:/run/kvservice \
#       -v "$PWD/cluster.key:/run/secrets/kvservice.key:ro" \
#       kvservice-sidecar --config /etc/kvservice/prefill.toml
#
# The cluster key is a secret file: the same one in every sidecar of the
# cluster, mode 0600 and owned by the sidecar's user (10001), or it is refused.
# The image reads it from /run/secrets/kvservice.key (KVSERVICE_AUTH_KEY_FILE);
# a sidecar that only ever talks to peers on loopback may run without one:
# -e KVSERVICE_AUTH_KEY_FILE= -e KVSERVICE_ALLOW_UNAUTHENTICATED=1 (the image
# has no home for a per-user key, and other containers would not share it).
#
# Workers share the socket volume (/run/kvservice) and the sidecar's IPC
# namespace (--ipc container:kv-prefill) and run as the same uid (10001): the
# socket and the shared KV segment are mode 0600, and the sidecar refuses
# workers of other uids (sidecar.allowed_uids).  See docs/sidecar.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Extra pip arguments for torch, e.g. --build-arg TORCH_PIP_ARGS="--index-url <an index of CPU-only builds>".
ARG TORCH_PIP_ARGS=""

WORKDIR /opt/kvservice
COPY pyproject.toml README.md ./
COPY kvservice/ ./kvservice/
# TORCH_PIP_ARGS holds pip options, not packages (every package here is pinned).
# hadolint ignore=DL3013,SC2086
RUN pip install $TORCH_PIP_ARGS "torch==2.13.0" \
    && pip install "nixl==1.5.1" "numpy==2.4.6" "anyio==4.16.0" "uvloop==0.23.0" \
        "structlog==26.1.0" "msgspec==0.23.0" \
        "aetcd==1.0.0" "grpcio==1.85.3" "protobuf==7.36.2" \
    && pip install --no-deps /opt/kvservice \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvservice \
    && mkdir -p /run/kvservice \
    && chown kvservice /run/kvservice

COPY config/ /etc/kvservice/

# The daemon's own settings for the container; anything else comes from the mounted config.
ENV KVSERVICE_SIDECAR_SOCKET_PATH=/run/kvservice/kvservice.sock \
    KVSERVICE_HTTP_PORT=9400 \
    KVSERVICE_LOG_FORMAT=json \
    KVSERVICE_AUTH_KEY_FILE=/run/secrets/kvservice.key

USER 10001
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['KVSERVICE_HTTP_PORT'], timeout=2)"]

ENTRYPOINT ["kvservice", "serve"]
CMD ["--config", "/etc/kvservice/prefill.toml"]
