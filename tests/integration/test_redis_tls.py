"""rediss:// with a password: the gateway shares its counts through a TLS-only redis-server (certificate
from a self-signed CA made by openssl, password from REDIS_PASSWORD), and the password never reaches its
log. A server whose certificate the CA did not sign is refused."""

from __future__ import annotations

import json
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from extproc.localstack import Proc, free_port, port_open, wait_until
from tests.integration.test_grpc_tls import make_ca, make_cert

PASSWORD = "s3cret-Passw0rd"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("redis-pki")
    make_ca(d, "ca")
    make_ca(d, "other")
    make_cert(d, "redis", "ca", "serverAuth")
    return d


def redis_up(admin: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("extproc_redis_up "):
                return float(line.split()[1])
    return None


@pytest.mark.parametrize("trusted", ["ca", "other"])
def test_rediss_with_password(pki: Path, tmp_path: Path, trusted: str) -> None:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing (make test installs it)"
    tls_port = free_port()
    redis = Proc("redis", [binary, "--port", "0", "--tls-port", str(tls_port), "--bind", "127.0.0.1",
                           "--tls-cert-file", str(pki / "redis.pem"),
                           "--tls-key-file", str(pki / "redis.key"),
                           "--tls-ca-cert-file", str(pki / "ca.pem"), "--tls-auth-clients", "no",
                           "--requirepass", PASSWORD, "--save", "", "--appendonly", "no"], tmp_path)
    gateway = None
    try:
        redis.wait_ready(lambda: port_open(tls_port))
        config = tmp_path / "gateway.yaml"
        config.write_text(json.dumps({
            "models": {"m": {"pods": [{"name": "p", "address": "127.0.0.1:9"}]}},
            "redis": {"url": f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={pki / f'{trusted}.pem'}"}}))
        port, admin = free_port(), free_port()
        gateway = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                                   "--port", str(port), "--admin-port", str(admin)], tmp_path,
                       env={"REDIS_PASSWORD": PASSWORD})
        gateway.wait_ready(lambda: redis_up(admin) is not None)
        if trusted == "ca":
            wait_until(lambda: redis_up(admin) == 1.0, 15, "Redis reachable over TLS")
        else:
            wait_until(lambda: "unreachable" in gateway.log(), 15, "the TLS failure logged")
            assert redis_up(admin) == 0.0
        assert PASSWORD not in gateway.log()
    finally:
        if gateway is not None:
            gateway.stop()
        redis.stop()
