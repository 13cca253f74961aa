"""scheduler.token_limits: one token over its share is refused while others go on; shares are given back
once (however often release is called); without tokens nothing is counted."""
from __future__ import annotations

import pytest

from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.token_limits import TokenLimits, cost
from tandem.errors import CapacityExceeded, InvalidRequest, TokenLimitExceeded
from tandem.security.tokens import Principal, Scope

ALICE, BOB = Principal("a" * 12, Scope.USER), Principal("b" * 12, Scope.USER)


def test_concurrency_is_per_token():
    limits = TokenLimits(max_concurrent=2)
    a1, a2 = limits.enter(ALICE), limits.enter(ALICE)
    with pytest.raises(TokenLimitExceeded, match="--max-concurrent-per-token 2"):
        limits.enter(ALICE)
    b = limits.enter(BOB)  # BOB is not held back by ALICE
    a1.release()
    a1.release()  # idempotent: ALICE gets exactly one slot back
    a3 = limits.enter(ALICE)
    with pytest.raises(TokenLimitExceeded):
        limits.enter(ALICE)
    for lease in (a2, a3, b):
        lease.release()
    assert limits.in_flight(ALICE) == (0, 0) and limits.in_flight(BOB) == (0, 0)


def test_concurrency_counts_choices():
    limits = TokenLimits(max_concurrent=4)
    with pytest.raises(InvalidRequest, match="5 choices"):  # more than the whole share: no retry can help
        limits.enter(ALICE, 5)
    three = limits.enter(ALICE, 3)
    with pytest.raises(TokenLimitExceeded, match="3 choices in flight"):
        limits.enter(ALICE, 2)
    one = limits.enter(ALICE, 1)
    assert limits.in_flight(ALICE) == (4, 0)
    three.release()
    three.release()
    assert limits.in_flight(ALICE) == (1, 0)
    limits.enter(ALICE, 3).release()
    one.release()
    assert limits.in_flight(ALICE) == (0, 0)


def test_tokens_are_per_token_and_released_with_the_request():
    limits = TokenLimits(max_tokens=100)
    with limits.enter(ALICE) as a:
        a.charge(60)
        second = limits.enter(ALICE)
        with pytest.raises(TokenLimitExceeded, match="--max-queued-tokens-per-token 100") as err:
            second.charge(41)
        assert isinstance(err.value, CapacityExceeded)  # RESOURCE_EXHAUSTED / 429
        second.charge(40)
        with limits.enter(BOB) as b:
            b.charge(100)
        second.release()
        assert limits.in_flight(ALICE) == (1, 60)
    assert limits.in_flight(ALICE) == (0, 0)


def test_off_without_limits_or_without_a_principal():
    for limits, principal in ((TokenLimits(), ALICE), (TokenLimits(1, 1), None)):
        leases = [limits.enter(principal) for _ in range(3)]
        for lease in leases:
            lease.charge(10**6)
            lease.release()


def test_cost_counts_prompts_and_every_possible_new_token():
    r = GenerateRequest("r", (1, 2, 3), StoppingCriteria(max_new_tokens=7))
    assert cost([r, r]) == 20
