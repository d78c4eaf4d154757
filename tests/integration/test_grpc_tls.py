"""TLS and mutual TLS on the gateway's gRPC port, with self-signed certificates made here by openssl:
a request through real Envoy (its ext_proc and access-log cluster over mTLS), clients without a
certificate or trusting another CA refused, and a certificate rotated on disk taking effect for new
connections without a restart; a bad set is refused at start-up and, later, without harm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.envoy_bootstrap import BootstrapOptions, bootstrap
from extproc.localstack import Proc, free_port, port_open, start_envoy, wait_until
from extproc.server.tls import ReloadingCredentials, TlsError, TlsSettings, read_checked
from tests.support.stack import start_upstream

TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(directory: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
            cwd=directory)


def make_cert(directory: Path, name: str, ca: str, usage: str) -> None:
    (directory / f"{name}.ext").write_text(
        f"subjectAltName=DNS:extproc-gateway,IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca1")
    make_ca(d, "ca2")
    make_cert(d, "server1", "ca1", "serverAuth")
    make_cert(d, "server2", "ca2", "serverAuth")
    make_cert(d, "client", "ca1", "clientAuth")
    return d


def health(port: int, ca: Path, client: tuple[Path, Path] | None) -> int | None:
    """The health status over a fresh TLS connection, or None when the handshake is refused."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return reply.status
        except grpc.RpcError:
            return None


def test_bad_sets_are_refused(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="server1.pem"):  # the key of another certificate
        read_checked(TlsSettings(pki / "server1.pem", pki / "server2.key"))
    (tmp_path / "half.pem").write_bytes((pki / "server1.pem").read_bytes()[:100])
    with pytest.raises(TlsError):
        read_checked(TlsSettings(tmp_path / "half.pem", pki / "server1.key"))
    with pytest.raises(TlsError, match="missing"):
        read_checked(TlsSettings(pki / "server1.pem", pki / "server1.key", tmp_path / "missing"))
    # a change to a bad set later is refused and the previous configuration stays
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes((pki / "server1.pem").read_bytes())
    key.write_bytes((pki / "server1.key").read_bytes())
    creds = ReloadingCredentials(TlsSettings(cert, key))
    assert creds.fetch() is None  # unchanged
    key.write_bytes((pki / "server2.key").read_bytes())
    assert creds.fetch() is None and creds.refused == 1 and creds.reloads == 0
    cert.write_bytes((pki / "server2.pem").read_bytes() + b"\n")
    assert creds.fetch() is not None and creds.reloads == 1


def test_mtls_through_envoy_and_rotation(pki: Path, tmp_path: Path) -> None:
    upstream, upstream_port = start_upstream("tls", tmp_path)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"  # what a mounted Secret would hold
    cert.write_bytes((pki / "server1.pem").read_bytes())
    key.write_bytes((pki / "server1.key").read_bytes())
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"models": {"m": {"pods": [
        {"name": "pod-a", "address": f"127.0.0.1:{upstream_port}"}]}}}))
    port, admin = free_port(), free_port()
    gateway = Proc("gateway", [sys.executable, "-m", "extproc", "serve", "--config", str(config),
                               "--port", str(port), "--admin-port", str(admin), "--tls-cert", str(cert),
                               "--tls-key", str(key), "--tls-client-ca", str(pki / "ca1.pem")], tmp_path)
    envoy = None
    try:
        gateway.wait_ready(lambda: port_open(port))
        client = (pki / "client.pem", pki / "client.key")
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health(port, pki / "ca1.pem", client) == serving
        assert health(port, pki / "ca1.pem", None) is None  # no client certificate: refused
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext: refused
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)

        # real Envoy: the ext_proc (and access-log) cluster over mTLS
        listen, envoy_admin = free_port(), free_port()
        boot = bootstrap(BootstrapOptions(listen_port=listen, extproc_port=port, admin_port=envoy_admin))
        (cluster,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "extproc"]
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": TLS_TYPE, "sni": "extproc-gateway", "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificates": [{"certificate_chain": {"filename": str(client[0])},
                                      "private_key": {"filename": str(client[1])}}],
                "validation_context": {
                    "trusted_ca": {"filename": str(pki / "ca1.pem")},
                    "match_typed_subject_alt_names": [{"san_type": "DNS",
                                                       "matcher": {"exact": "extproc-gateway"}}]}}}}
        envoy = start_envoy("envoy", yaml.safe_dump(boot, sort_keys=False), tmp_path)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

        def routed() -> bool:
            request = urllib.request.Request(f"http://127.0.0.1:{listen}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status == 200 and response.headers.get("target-pod") == "pod-a"

        wait_until(routed, 20, "a request routed through Envoy over mTLS")

        # rotation: a certificate from another CA replaces the files; new connections get it
        os.replace(_copy(pki / "server2.key", tmp_path / "new.key"), key)
        os.replace(_copy(pki / "server2.pem", tmp_path / "new.pem"), cert)
        wait_until(lambda: health(port, pki / "ca2.pem", client) == serving, 10, "the rotated certificate")
        assert health(port, pki / "ca1.pem", client) is None  # the old CA no longer verifies it
        assert gateway.popen.poll() is None
    finally:
        if envoy is not None:
            envoy.stop()
        gateway.stop()
        upstream.stop()


def _copy(source: Path, target: Path) -> Path:
    target.write_bytes(source.read_bytes())
    return target


def test_serve_refuses_a_key_without_certificate(pki: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("models: {m: {pods: []}}\n")
    out = subprocess.run([sys.executable, "-m", "extproc", "serve", "--config", str(config), "--port",
                          str(free_port()), "--admin-port", str(free_port()), "--tls-key",
                          str(pki / "server1.key")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--tls-cert" in out.stderr
