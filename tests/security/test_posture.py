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
        check_exposure("0.0.0.0", ["gRPC"], tls=False, tokens=False, insecure=False)
    assert "--insecure" in str(err.value) and "--tls-cert" in str(err.value) and "--auth-token-file" in str(err.value)
    assert check_exposure("0.0.0.0", ["gRPC"], tls=True, tokens=False, insecure=False) is None
    assert check_exposure("127.0.0.1", ["gRPC"], tls=False, tokens=False, insecure=False) is None
    assert check_exposure("0.0.0.0", [], tls=False, tokens=False, insecure=False) is None  # a Unix socket only


def test_tokens_without_tls_on_an_exposed_port_need_insecure():
    """Case 9: tokens without TLS would travel in clear; every port on the host counts."""
    for ports in (["gRPC"], ["HTTP"], ["metrics"], ["gRPC", "HTTP", "metrics"]):
        with pytest.raises(InsecureBinding) as err:
            check_exposure("0.0.0.0", ports, tls=False, tokens=True, insecure=False)
        assert "--insecure" in str(err.value) and "--tls-cert" in str(err.value) and "in clear" in str(err.value)
        assert ", ".join(ports) in str(err.value)
    assert check_exposure("10.0.0.5", ["gRPC"], tls=True, tokens=True, insecure=False) is None
    assert check_exposure("::1", ["gRPC"], tls=False, tokens=True, insecure=False) is None


def test_insecure_lets_plaintext_through_with_a_warning():
    for tokens in (False, True):
        warning = check_exposure("0.0.0.0", ["gRPC", "metrics"], tls=False, tokens=tokens, insecure=True)
        assert warning.startswith("INSECURE: listening on 0.0.0.0 (gRPC, metrics) without TLS (--insecure)")
        assert ("bearer tokens" in warning) == tokens


def test_posture_line():
    assert posture_line(True, True, "3 tokens, 1 admin", False, True) == \
        "security: TLS on (mTLS), tokens on (3 tokens, 1 admin), reflection off, health open"
    assert posture_line(False, False, None, True, True, ["to executors: TLS off, token off"]) == \
        "security: TLS off, tokens off, reflection on, health open, to executors: TLS off, token off"
