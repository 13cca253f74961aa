"""Which executors a request may go to in each phase (scheduler/fleet/disaggregation.py): prompts to prefill (or
both) executors, decodes to decode (or both) ones, anything when no serving executor fits, never a draining
or avoided one; a fleet naming no role is unchanged. A request that moves with its cache goes only (hand-off) or
preferably (drain) to executors whose KV layout is the source's: never to a tensor-parallel one from another.
The same with real processes: tests/e2e/test_kv_migration.py."""
from __future__ import annotations

from scheduler.executor.info import ExecutorInfo
from scheduler.fleet.disaggregation import by_kv, eligible, kv_can_move
from tandem.capabilities import KV_TRANSFER

LAYOUT = "weights=ab12;weight_format=float;quantization=none;kv_dtype=float32;block_size=16;layout=2x2x16;window=0"
TP2 = LAYOUT + ";tensor_parallel=2 ranks, not transferable (1f3a9c07)"  # (executor_service/kv/fingerprint.py)


class _Engine:  # (what eligible and by_kv read of an engine: its info; hashable, by identity, as engines are)
    def __init__(self, role: str, fingerprint: str = LAYOUT, transfer: bool = True) -> None:
        self.info = ExecutorInfo(role=role, kv_fingerprint=fingerprint,
                                 capabilities=frozenset({KV_TRANSFER} if transfer else ()))


def _engine(role: str, fingerprint: str = LAYOUT, transfer: bool = True) -> _Engine:
    return _Engine(role, fingerprint, transfer)


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


def test_kv_moves_only_between_executors_of_one_layout_that_both_transfer():
    plain, other, tp2 = _engine("both"), _engine("both"), _engine("both", TP2)
    assert kv_can_move(plain.info, other.info) and not kv_can_move(plain.info, tp2.info)
    assert not kv_can_move(tp2.info, plain.info)
    assert not kv_can_move(plain.info, _engine("both", transfer=False).info)  # (an import it cannot do)
    assert kv_can_move(plain.info, _engine("both", fingerprint="").info)  # an older executor states none: tried


def test_a_hand_off_goes_only_where_the_kv_can_go_else_the_request_stays():
    p, tp2, d = _engine("prefill"), _engine("decode", TP2), _engine("decode")
    assert by_kv(eligible([p, tp2, d], "decode", set(), avoid=p), p, "only") == [d]
    assert by_kv(eligible([p, tp2], "decode", set(), avoid=p), p, "only") == []  # it decodes where it is


def test_a_move_off_a_draining_executor_prefers_its_layout_and_else_takes_any():
    src, tp2, d = _engine("both"), _engine("both", TP2), _engine("both")
    assert by_kv(eligible([src, tp2, d], "decode", set(), avoid=src), src, "prefer") == [d]
    assert by_kv(eligible([src, tp2], "decode", set(), avoid=src), src, "prefer") == [tp2]  # (recomputed there)
    assert by_kv(eligible([src, tp2, d], "prompt", set(), avoid=src), src, "none") == [tp2, d]  # no cache to take
