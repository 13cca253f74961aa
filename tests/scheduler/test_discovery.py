"""scheduler.discovery: --executor targets to addresses (plain, unix:, dns:/// resolved)."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.discovery import is_dns, resolve, resolve_all, split_host_port


def test_plain_targets_stand_for_themselves_and_dns_names_resolve():
    assert asyncio.run(resolve("10.0.0.7:50051")) == ["10.0.0.7:50051"]
    assert asyncio.run(resolve("unix:/run/tandem.sock")) == ["unix:/run/tandem.sock"]
    got = asyncio.run(resolve("dns:///localhost:50051"))
    assert "127.0.0.1:50051" in got and all(a.endswith(":50051") for a in got)
    assert asyncio.run(resolve("dns:///no-such-host.invalid:50051")) == []


def test_resolve_all_keeps_order_and_drops_repeats():
    got = asyncio.run(resolve_all(["10.0.0.2:1", "10.0.0.1:1", "10.0.0.2:1"]))
    assert got == ["10.0.0.2:1", "10.0.0.1:1"]


def test_dns_targets_need_a_port():
    assert is_dns("dns:///x:1") and not is_dns("x:1")
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    with pytest.raises(ValueError, match="NAME:PORT"):
        split_host_port("executors")
