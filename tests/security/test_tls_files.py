"""tandem.security.tls: certificate files are checked at startup (errors name the flag), re-read after a
change (a new version), and a set that does not load is refused while the one before stays in use."""
from __future__ import annotations

import os
import shutil

import pytest

from tandem.security.tls import ReloadingTls, TlsConfigError, load, server_paths
from tests.security_fixtures import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_startup_errors_name_the_flag(pki, tmp_path):
    cert, key = pki.server()
    with pytest.raises(TlsConfigError, match="^--tls-cert: cannot read .*: No such file"):
        load(server_paths(tmp_path / "missing.pem", key, None))
    other_cert, _ = pki.other.server()
    with pytest.raises(TlsConfigError, match="^--tls-cert / --tls-key: not a PEM certificate chain and its matching"):
        load(server_paths(other_cert, key, None))  # a key that is not the certificate's
    with pytest.raises(TlsConfigError, match="^--tls-client-ca: no PEM CA certificate"):
        load(server_paths(cert, key, key))
    assert load(server_paths(cert, key, pki.ca)).ca == pki.ca.read_bytes()


def test_reload_bumps_the_version_and_a_broken_set_keeps_the_old_one(pki, tmp_path):
    cert, key = pki.server()
    for src, name in ((cert, "server.pem"), (key, "server.key")):
        shutil.copy(src, tmp_path / name)
    tls = ReloadingTls(server_paths(tmp_path / "server.pem", tmp_path / "server.key", None), interval_s=3600)
    first = tls.material
    assert tls.refresh() == 0  # nothing changed (and not looked at before the interval)
    other_cert, other_key = pki.other.server()
    shutil.copy(other_cert, tmp_path / "server.pem")  # half a rotation: the key does not match yet
    tls.reload_now()
    assert tls.refresh() == 0 and tls.material is first
    shutil.copy(other_key, tmp_path / "server.key")
    os.utime(tmp_path / "server.key")
    tls.reload_now()  # SIGHUP
    assert tls.refresh() == 1 and tls.material.cert == other_cert.read_bytes()
