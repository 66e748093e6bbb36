"""The pure halves of issue 9: which refusals waiting can cure, and how a thinking request is bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.admission.room import TAIL_MIN_TOKENS, Plan, plan_output
from quotawrap.core.estimate import (
    MAX_OUTPUT_TOKENS,
    Estimate,
    EstimateSettings,
    bound_field,
    bounded,
    learned_allowance,
    output_allowance,
    unbounded_thinking,
)
from quotawrap.core.quota import Counters, Limit, never_fits, token_room, verdict

RUN = Limit("run_cap", "run", 20_000)
DAY = Limit("daily_cap", "model_day", 100_000)
WALL = Limit("usage_wall", "model_day", 90_000, "wall")
COST = Limit("cost_cap", "run_cost", 1_000)


class TestNeverFits:
    def test_in_flight_alone_in_the_way(self) -> None:
        """Refused now, but settled + reserve fits: waiting can cure it."""
        counters = {"run": Counters(settled=5_000, in_flight=12_000)}
        assert not verdict([RUN], counters, 4_000).allowed
        assert never_fits([RUN], counters, 4_000) is None

    def test_settled_plus_reserve_over_the_cap(self) -> None:
        """Settled usage only grows: a reserve it leaves no room for never fits."""
        assert never_fits([RUN], {"run": Counters(settled=17_000)}, 4_000) == RUN

    def test_crossed_wall(self) -> None:
        """An evicted model is refused at once, whatever the call asks."""
        assert never_fits([DAY, WALL], {"model_day": Counters(settled=90_000)}, 1) == WALL

    def test_cost_cap_counts_the_reserve_cost(self) -> None:
        """The money cap compares micro-CNY, not tokens."""
        counters = {"run_cost": Counters(settled=900)}
        assert never_fits([COST], counters, 10**6, reserve_cost=50) is None
        assert never_fits([COST], counters, 1, reserve_cost=200) == COST

    def test_exactly_at_the_cap_fits(self) -> None:
        """settled + reserve == cap is a fit, as in the verdict."""
        assert never_fits([RUN], {"run": Counters(settled=16_000)}, 4_000) is None


class TestTokenRoom:
    def test_tightest_token_limit(self) -> None:
        """The least room of the token hold limits, in flight ignored (it will settle)."""
        counters = {"run": Counters(settled=15_000, in_flight=3_000), "model_day": Counters(settled=99_000)}
        assert token_room([RUN, DAY, WALL, COST], counters) == 1_000

    def test_no_token_limit(self) -> None:
        """Only walls and a money cap: nothing to fit a bound into."""
        assert token_room([WALL, COST], {}) is None


class TestUnboundedThinking:
    @pytest.mark.parametrize(
        ("kind", "body", "expected"),
        [
            ("chat", {"max_tokens": 64}, True),
            ("chat", {}, True),
            ("chat", {"max_completion_tokens": 500}, False),
            ("chat", {"max_completion_tokens": 0}, True),  # 0 reads as absent
            ("chat", {"thinking": {"type": "disabled"}}, False),
            ("responses", {}, True),
            ("responses", {"max_output_tokens": 800}, False),
            ("embeddings", {}, False),
            ("completions", {}, False),
        ],
    )
    def test_table(self, kind: str, body: dict, expected: bool) -> None:
        """Only a request that may think and bounds nothing of its whole output is open."""
        assert unbounded_thinking(kind, {"model": "m", **body}) is expected  # type: ignore[arg-type]


class TestBounded:
    def test_chat_gains_the_bound_in_place_of_max_tokens(self) -> None:
        """max_completion_tokens goes out without max_tokens: Ark answers 400 to a request with both."""
        body = {"model": "m", "max_tokens": 64, "n": 2}
        shaped = bounded("chat", body, 5_000)
        assert shaped == {"model": "m", "n": 2, "max_completion_tokens": 5_000}
        assert output_allowance("chat", shaped) == 10_000  # per choice
        assert body == {"model": "m", "max_tokens": 64, "n": 2}  # the caller's dict is untouched

    def test_a_null_max_tokens_goes_too(self) -> None:
        """A max_tokens of null (the SDKs' unset) is a field all the same: never sent beside the bound."""
        assert bounded("chat", {"model": "m", "max_tokens": None}, 7) == {"model": "m", "max_completion_tokens": 7}

    def test_responses(self) -> None:
        """The Responses API's whole-output field is max_output_tokens."""
        assert bound_field("responses") == "max_output_tokens"
        assert bounded("responses", {"model": "m"}, 7)["max_output_tokens"] == 7

    def test_no_field_to_bound(self) -> None:
        """Embeddings have nothing to bound: a clear error, not a silent no-op."""
        with pytest.raises(ValueError, match="no field"):
            bounded("embeddings", {"model": "m"}, 1)


class TestLearnedAllowance:
    def test_no_history(self) -> None:
        """Nothing settled yet: the caller falls back to the seed's reserve."""
        assert learned_allowance([], floor=4_096) is None

    def test_floor(self) -> None:
        """Short answers do not shrink the allowance below the floor."""
        assert learned_allowance([20, 30, 40], floor=4_096) == 4_096

    def test_p99_nearest_rank(self) -> None:
        """Of 200 outputs the 198th smallest: the two longest are the 1% it may cut."""
        outputs = list(range(1, 201))
        assert learned_allowance([o * 100 for o in outputs], floor=1) == 19_800

    def test_few_calls_take_the_largest(self) -> None:
        """Under 100 calls the p99 is the largest seen."""
        assert learned_allowance([5_000, 30_000, 9_000], floor=4_096) == 30_000

    @given(st.lists(st.integers(min_value=0, max_value=200_000), min_size=1, max_size=1_500))
    def test_the_nearest_rank_p99_of_any_history(self, outputs: list[int]) -> None:
        """Picked without sorting the whole history (a heap of its top 1%): the sorted list's p99 exactly."""
        ordered = sorted(outputs)
        p99 = ordered[max(1, -(-99 * len(ordered) // 100)) - 1]  # nearest rank: ceil(0.99 n)
        assert learned_allowance(outputs, floor=0, ceiling=10**9) == p99

    def test_ceiling(self) -> None:
        """Never above what Ark accepts as max_completion_tokens."""
        assert learned_allowance([10**6], floor=1) == MAX_OUTPUT_TOKENS


class TestPlanOutput:
    """admission.plan_output for a request that sets no bound at all: the bound the guard adds, fitted to the cap."""

    @staticmethod
    def _plan(request: dict, reasoning: int | None, space: int | None = None, ceiling: int = 32_768) -> Plan:
        body = {"model": "m", "messages": [], **request}
        return plan_output(
            "chat",
            body,
            Estimate(100, 0),
            EstimateSettings(),
            boundable=True,
            policy="ceiling",
            ceiling=ceiling,
            reasoning=reasoning,
            token_space=lambda: space,
        )

    def test_default_answer_plus_learned_reasoning(self) -> None:
        """The default answer keeps its room and reasoning gets its p99; the hold is input + that bound."""
        plan = self._plan({}, reasoning=6_000)
        assert plan.bound == 10_096
        assert plan.body["max_completion_tokens"] == 10_096
        assert plan.estimate.total == 10_196

    def test_floor(self) -> None:
        """A model that never reasons keeps max(default answer, floor)."""
        assert self._plan({}, reasoning=0).bound == 4_096

    def test_no_history_takes_the_default_answer_plus_the_floor(self) -> None:
        """Nothing learned yet: 4,096 + 4,096, small and exact (no longer the seed's 50,000)."""
        assert self._plan({}, reasoning=None).bound == 8_192

    def test_never_above_the_requests_own_worst_case(self) -> None:
        """The default answer + the model's reasoning ceiling is what the request could ever cost unbounded."""
        assert self._plan({}, reasoning=60_000, ceiling=1_000).bound == 5_096
        assert self._plan({}, reasoning=None, ceiling=0).bound == 4_096  # a model that does not reason
        assert self._plan({}, reasoning=200_000, ceiling=10**6).bound == MAX_OUTPUT_TOKENS

    def test_fitted_to_the_room_but_not_below_the_floor(self) -> None:
        """A bound the cap's settled usage cannot hold shrinks to the room, not under the floor while
        the room holds the floor."""
        assert self._plan({}, reasoning=20_000, space=20_100).bound == 20_000
        assert self._plan({}, reasoning=0, space=4_196).bound == 4_096
        assert self._plan({}, reasoning=None, space=4_000_000).bound == 8_192

    def test_a_caps_last_room_is_offered_rather_than_refused(self) -> None:
        """Below the floor, the call gets all the room left if that holds TAIL_MIN_TOKENS: sent bounded there,
        not refused; below that, the floor as before."""
        assert self._plan({}, reasoning=3_000, space=1_600).bound == 1_500
        assert self._plan({}, reasoning=3_000, space=100 + TAIL_MIN_TOKENS).bound == TAIL_MIN_TOKENS
        assert self._plan({}, reasoning=3_000, space=99 + TAIL_MIN_TOKENS).bound == 4_096

    def test_a_cap_too_small_for_one_call_still_refuses(self) -> None:
        """Only a cap's end is offered: a cap that cannot hold one call at the floor keeps refusing it."""
        body = {"model": "m", "messages": []}

        def bound(cap: int) -> int | None:
            return plan_output(
                "chat",
                body,
                Estimate(100, 0),
                EstimateSettings(),
                boundable=True,
                policy="ceiling",
                ceiling=32_768,
                reasoning=3_000,
                token_space=lambda: 1_600,
                token_cap=lambda: cap,
            ).bound

        assert bound(100_000) == 1_500
        assert bound(100 + 4_096) == 1_500
        assert bound(99 + 4_096) == 4_096
