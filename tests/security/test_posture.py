"""Safe by default: which addresses count as loopback, when a server refuses to start, the posture line."""
from __future__ import annotations

import pytest

from tandem.security.posture import InsecureBinding, check_exposure, is_loopback, posture_line


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("10.0.0.5", False), ("example.internal", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) == loopback


def test_exposed_without_tls_or_tokens_needs_insecure():
    with pytest.raises(InsecureBinding) as err:
        check_exposure("0.0.0.0", True, tls=False, tokens=False, insecure=False)
    assert "--insecure" in str(err.value) and "--tls-cert" in str(err.value) and "--auth-token-file" in str(err.value)
    for kw in (dict(tls=True, tokens=False, insecure=False), dict(tls=False, tokens=True, insecure=False),
               dict(tls=False, tokens=False, insecure=True)):
        check_exposure("0.0.0.0", True, **kw)
    check_exposure("127.0.0.1", True, tls=False, tokens=False, insecure=False)
    check_exposure("0.0.0.0", False, tls=False, tokens=False, insecure=False)  # a Unix socket only


def test_posture_line():
    assert posture_line(True, True, "3 tokens, 1 admin", False, True) == \
        "security: TLS on (mTLS), tokens on (3 tokens, 1 admin), reflection off, health open"
    assert posture_line(False, False, None, True, True, ["to executors: TLS off, token off"]) == \
        "security: TLS off, tokens off, reflection on, health open, to executors: TLS off, token off"
