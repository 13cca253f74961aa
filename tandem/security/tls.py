"""TLS for both servers and for the scheduler's link to its executors, with certificates that are read again,
without a restart and without touching connections already open, when their files change (looked at no more
than once per second) or on SIGHUP:

- gRPC servers: grpc.dynamic_ssl_server_credentials. gRPC asks our fetcher at every new TLS handshake; it
  answers a new certificate configuration after a change, so new connections get the new certificate (and the
  new client CA) while every stream on an older connection goes on.
- the HTTP front (uvicorn): an SSLContext whose SNI callback (run at every handshake, SNI sent or not) moves
  the handshake onto a context built from the current files, with the same effect.
- the scheduler's channels to executors: ClientTls.version changes, and the client opens a new channel for
  new calls (scheduler/executor/client.py).

A file set that does not load (a half-written rotation, a key that does not match) is refused with a log line
and the certificates read before stay in force. At startup it is an error naming the flag.
"""
from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from tandem.security.file_watch import CHECK_INTERVAL_S, FileWatch

log = logging.getLogger("tandem.security")


class TlsConfigError(ValueError):
    """Certificate files that cannot be used; says which flag."""


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes: a certificate chain and its key (both or neither), and CA certificates (or None)."""
    cert: bytes | None
    key: bytes | None
    ca: bytes | None


@dataclass(frozen=True)
class TlsPaths:
    """Paths and the flags that named them (for messages): cert_flag names the certificate, and so on."""
    cert: Path | None
    key: Path | None
    ca: Path | None
    cert_flag: str
    key_flag: str
    ca_flag: str

    def files(self) -> list[Path]:
        return [p for p in (self.cert, self.key, self.ca) if p is not None]


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def load(paths: TlsPaths) -> TlsMaterial:
    """Reads and checks the files: the key must match the certificate, the CA file must hold certificates."""
    if (paths.cert is None) != (paths.key is None):
        raise TlsConfigError(f"{paths.cert_flag} and {paths.key_flag} go together: give both or neither")
    material = TlsMaterial(_read(paths.cert, paths.cert_flag), _read(paths.key, paths.key_flag),
                           _read(paths.ca, paths.ca_flag))
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # only to parse: the same checks a handshake would make
    if paths.cert is not None:
        try:
            check.load_cert_chain(paths.cert, paths.key)
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(f"{paths.cert_flag} / {paths.key_flag}: not a PEM certificate chain and its "
                                 f"matching private key ({getattr(exc, 'reason', None) or exc})") from None
    if material.ca is not None:
        try:
            check.load_verify_locations(cadata=material.ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise TlsConfigError(f"{paths.ca_flag}: no PEM CA certificate in the file "
                                 f"({getattr(exc, 'reason', None) or exc})") from None
    return material


class ReloadingTls:
    """The current material of a set of TLS files. refresh() (cheap: a stat per second at most) reads them
    again after a change and bumps .version; consumers compare versions."""

    def __init__(self, paths: TlsPaths, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.paths = paths
        self._lock = threading.Lock()
        self.material = load(paths)
        self.version = 0
        self._watch = FileWatch(paths.files(), interval_s)

    def reload_now(self) -> None:
        """SIGHUP: read the files again at the next handshake."""
        self._watch.force()

    def refresh(self) -> int:
        if self._watch.changed():
            try:
                material = load(self.paths)
            except TlsConfigError as exc:
                log.error("certificate reload refused: %s; the certificates read before stay in use", exc)
            else:
                with self._lock:
                    self.material, self.version = material, self.version + 1
                log.info("certificates re-read (%s): new connections use them", self.paths.cert_flag)
        return self.version


def server_paths(cert: Path, key: Path, client_ca: Path | None) -> TlsPaths:
    return TlsPaths(cert, key, client_ca, "--tls-cert", "--tls-key", "--tls-client-ca")


def grpc_server_credentials(tls: ReloadingTls) -> grpc.ServerCredentials:
    """TLS (mTLS with a client CA: client certificates required and checked) that follows the files."""
    def configuration(m: TlsMaterial):
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    seen = [tls.version]

    def fetch():  # called by gRPC before each new handshake; None = keep the configuration in use
        try:
            version = tls.refresh()
            if version == seen[0]:
                return None
            seen[0] = version
            return configuration(tls.material)
        except Exception:  # never fail a handshake for our bookkeeping
            log.exception("certificate reload failed; the certificates read before stay in use")
            return None

    return grpc.dynamic_ssl_server_credentials(configuration(tls.material), fetch,
                                               require_client_authentication=tls.material.ca is not None)


def reloading_ssl_context(tls: ReloadingTls, build: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """The SSLContext for a Python server (uvicorn): build() makes one from the files (uvicorn's own factory,
    with its settings); after a change each new handshake is moved onto a freshly built context."""
    first = build()
    current = {"version": tls.version, "context": first}
    lock = threading.Lock()

    def on_hello(ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        version = tls.refresh()
        with lock:
            if version != current["version"]:
                try:
                    current["context"] = build()
                except (ssl.SSLError, OSError) as exc:  # the files changed again under us: next time
                    log.error("HTTP certificate reload failed (%s); the certificates read before stay in use", exc)
                current["version"] = version
            fresh = current["context"]
        if fresh is not first:
            ssl_object.context = fresh  # this handshake's certificate and client CA come from the new files

    first.sni_callback = on_hello
    return first


def client_paths(ca: Path | None, cert: Path | None, key: Path | None) -> TlsPaths:
    return TlsPaths(cert, key, ca, "--executor-tls-cert", "--executor-tls-key", "--executor-tls-ca")


class ClientTls:
    """The scheduler's TLS to its executors: the CA that signs their certificates (None: the system's roots),
    its own certificate for mTLS (optional), and the name their certificates must carry when it is not the
    host of the address dialled (dns:/// targets resolve to pod IPs: their certificates name the Service)."""

    def __init__(self, paths: TlsPaths, server_name: str | None = None) -> None:
        self.tls = ReloadingTls(paths)
        self.server_name = server_name

    def version(self) -> int:
        """Bumped when the files changed and were read again: open new channels then (cheap to ask)."""
        return self.tls.refresh()

    def credentials(self) -> grpc.ChannelCredentials:
        m = self.tls.material
        return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)

    def reload_now(self) -> None:
        self.tls.reload_now()
