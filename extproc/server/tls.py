"""TLS, and mutual TLS, for the ext_proc gRPC server (Envoy -> gateway), reloaded when the files change.

gRPC asks `ReloadingCredentials.fetch` before each new handshake; when a file's stamp (mtime, size)
has changed, the new certificate, key and client CA are read, checked (the key must match the
certificate, the PEM must parse) and used for every connection from then on. Connections already open
keep their session. A half-written or mismatched set is refused with a log line and the previous one
keeps serving, so a Secret update that lands file by file never takes the gateway down.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsSettings:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: clients must present a certificate signed by it (mTLS)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def files(self) -> tuple[Path, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())


class TlsError(ValueError):
    pass


def _stamp(paths: tuple[Path, ...]) -> tuple[tuple[int, int] | None, ...]:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def read_checked(settings: TlsSettings) -> tuple[bytes, bytes, bytes | None]:
    """The certificate chain, key and client CA, each checked; raises TlsError naming the file."""
    try:
        cert = settings.cert_file.read_bytes()
        key = settings.key_file.read_bytes()
        ca = settings.client_ca_file.read_bytes() if settings.client_ca_file else None
    except OSError as exc:
        raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from None
    # ssl checks that the PEM parses and the key belongs to the certificate; it wants paths, so the
    # bytes just read (not the files, which may change meanwhile) are checked from a private copy.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert)
        key_path.write_bytes(key)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, ValueError) as exc:
            raise TlsError(f"{settings.cert_file} / {settings.key_file}: {exc}") from None
    if ca is not None:
        try:
            ssl.create_default_context(cadata=ca.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
            raise TlsError(f"{settings.client_ca_file}: not a PEM CA bundle ({exc})") from None
    return cert, key, ca


class ReloadingCredentials:
    """gRPC server credentials whose certificate follows the files."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()  # gRPC calls fetch from its own threads
        self._stamp = _stamp(settings.files())
        self._config = self._configuration(*read_checked(settings))  # a bad set at start is fatal
        self.reloads = 0
        self.refused = 0

    @staticmethod
    def _configuration(cert: bytes, key: bytes, ca: bytes | None) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None: keep the current configuration (gRPC's contract for the fetcher)."""
        with self._lock:
            stamp = _stamp(self.settings.files())
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                config = self._configuration(*read_checked(self.settings))
            except TlsError as exc:
                self.refused += 1
                log.error("TLS files changed but cannot be used, keeping the previous ones: %s", exc)
                return None
            self._config = config
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.settings.cert_file)
            return config

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config, self.fetch,
                                                   require_client_authentication=self.settings.mutual)


def settings_from(cert: str | None, key: str | None, client_ca: str | None) -> TlsSettings | None:
    """From `extproc serve`'s flags: none set is plaintext; a certificate needs its key."""
    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        raise TlsError("TLS needs both --tls-cert and --tls-key (--tls-client-ca adds mutual TLS)")
    return TlsSettings(Path(cert), Path(key), Path(client_ca) if client_ca else None)
