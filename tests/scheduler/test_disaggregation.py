"""Which executors a request may go to in each phase (scheduler/fleet/disaggregation.py): prompts to prefill (or
both) executors, decodes to decode (or both) ones, anything when no serving executor fits, never a draining
or avoided one; a fleet naming no role is unchanged."""
from __future__ import annotations

from types import SimpleNamespace

from scheduler.fleet.disaggregation import eligible


class _Engine:  # (what eligible reads of an engine: its info's role; hashable, by identity, as engines are)
    def __init__(self, role: str) -> None:
        self.info = SimpleNamespace(role=role)


def _engine(role: str) -> _Engine:
    return _Engine(role)


def test_prompts_go_to_prefill_executors_and_decodes_to_decode_ones():
    p, d = _engine("prefill"), _engine("decode")
    assert eligible([p, d], "prompt", set()) == [p]
    assert eligible([p, d], "decode", set()) == [d]


def test_both_executors_take_either_phase_beside_the_specialised_ones():
    p, b, d = _engine("prefill"), _engine("both"), _engine("decode")
    assert eligible([p, b, d], "prompt", set()) == [p, b]
    assert eligible([p, b, d], "decode", set()) == [b, d]


def test_a_fleet_without_roles_routes_as_before():
    a, b = _engine("both"), _engine("both")
    assert eligible([a, b], "prompt", set()) == [a, b] == eligible([a, b], "decode", set())


def test_with_no_fitting_executor_any_serving_one_takes_the_work():
    p1, p2 = _engine("prefill"), _engine("prefill")
    assert eligible([p1, p2], "decode", set()) == [p1, p2]
    assert eligible([_engine("decode")], "prompt", set())[0].info.role == "decode"


def test_draining_and_avoided_executors_take_nothing():
    p, d1, d2 = _engine("prefill"), _engine("decode"), _engine("decode")
    assert eligible([p, d1, d2], "decode", {d1}) == [d2]
    assert eligible([p, d1, d2], "decode", {d1}, avoid=d2) == [p]  # (nowhere fitting: any serving one)
    assert eligible([p], "prompt", set(), avoid=p) == []
