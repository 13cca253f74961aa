"""scheduler.fleet.discovery: --executor targets to addresses (plain, unix:, dns:/// resolved)."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.fleet.discovery import is_dns, resolve, resolve_all, resolve_named, split_host_port


def test_plain_targets_stand_for_themselves_and_dns_names_resolve():
    assert asyncio.run(resolve("10.0.0.7:50051")) == ["10.0.0.7:50051"]
    assert asyncio.run(resolve("unix:/run/tandem.sock")) == ["unix:/run/tandem.sock"]
    got = asyncio.run(resolve("dns:///localhost:50051"))
    assert "127.0.0.1:50051" in got and all(a.endswith(":50051") for a in got)
    assert asyncio.run(resolve("dns:///no-such-host.invalid:50051")) == []


def test_resolve_all_keeps_order_and_drops_repeats():
    got = asyncio.run(resolve_all(["10.0.0.2:1", "10.0.0.1:1", "10.0.0.2:1"]))
    assert got == ["10.0.0.2:1", "10.0.0.1:1"]


def test_resolve_named_says_which_dns_name_an_address_came_from():
    """TLS checks an executor found through dns:///NAME against NAME, not the address dialled."""
    got = asyncio.run(resolve_named(["10.0.0.2:1", "dns:///localhost:50051", "unix:/x.sock"]))
    assert list(got)[0] == "10.0.0.2:1" and got["10.0.0.2:1"] is None and got["unix:/x.sock"] is None
    assert got["127.0.0.1:50051"] == "localhost"


def test_dns_targets_need_a_port():
    assert is_dns("dns:///x:1") and not is_dns("x:1")
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    with pytest.raises(ValueError, match="NAME:PORT"):
        split_host_port("executors")
