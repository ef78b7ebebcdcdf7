"""Limits per key or key group: token buckets by the minute, requests in flight, OpenAI's headers."""

from __future__ import annotations

import pytest

from router.config import Fairness
from router.errors import RateLimited
from router.routing.limits import Limiter, _duration


def _limiter(**config: object) -> Limiter:
    limiter = Limiter()
    limiter.configure(Fairness.model_validate(config))
    return limiter


GROUP = {"groups": {"team": {"keys_env": "UNSET_TEST_KEYS", "requests_per_minute": 2}}}


@pytest.mark.parametrize(
    ("seconds", "written"),
    [(0.0, "0ms"), (0.0121, "13ms"), (0.9991, "1s"), (1.0, "1s"), (1.5, "1.5s"), (360.0, "6m0s"), (3725.0, "1h2m5s")],
)
def test_a_wait_is_written_as_openai_writes_it(seconds: float, written: str) -> None:
    assert _duration(seconds) == written


def test_requests_per_minute_refill_and_answer_the_wait() -> None:
    limiter = _limiter(**GROUP)
    first = limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=0.0)
    assert first is not None
    assert first.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
    }
    limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=0.0)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=10.0)
    error = refused.value
    assert (error.status_code, error.error_type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers()["Retry-After"] == "20" and error.headers()["retry-after-ms"] == "20000"
    assert error.headers()["x-ratelimit-remaining-requests"] == "0"
    # Another key of the group has its own bucket (the group is not `shared`)...
    assert limiter.admit(client="key:b addr:x", key="b", group="team", prompt_tokens=1, now=10.0) is not None
    # ...and the first one's refills at two a minute: one more 30 s after the two.
    assert limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=30.0) is not None


def test_a_shared_group_counts_its_keys_together() -> None:
    limiter = _limiter(groups={"team": {"keys_env": "UNSET_TEST_KEYS", "requests_per_minute": 2, "shared": True}})
    for key in ("a", "b"):
        limiter.admit(client=f"key:{key} addr:x", key=key, group="team", prompt_tokens=1, now=0.0)
    with pytest.raises(RateLimited):
        limiter.admit(client="key:c addr:x", key="c", group="team", prompt_tokens=1, now=0.0)


def test_tokens_count_the_prompt_on_arrival_and_the_answer_when_known() -> None:
    limiter = _limiter(default_limits={"tokens_per_minute": 1000})
    admitted = limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=100, now=0.0)
    assert admitted is not None and admitted.headers["x-ratelimit-remaining-tokens"] == "900"
    # The engine counted 120 prompt tokens and answered 700.
    limiter.finish(admitted, prompt_tokens=120, answer_tokens=700, now=0.0)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=400, now=0.0)
    assert refused.value.error_type == "tokens"
    assert refused.value.headers()["x-ratelimit-remaining-tokens"] == "180"
    assert refused.value.retry_after == pytest.approx((400 - 180) * 60 / 1000)
    # A prompt larger than the whole minute's tokens waits for a full bucket, not forever.
    later = limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=5000, now=60.0)
    assert later is not None and later.charged == 1000


def test_requests_in_flight_are_capped_and_given_back() -> None:
    limiter = _limiter(default_limits={"max_in_flight": 2})
    held = [limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=1, now=0.0) for _ in range(2)]
    with pytest.raises(RateLimited):
        limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=1, now=0.0)
    assert held[0] is not None
    limiter.finish(held[0], prompt_tokens=None, answer_tokens=None, now=0.0)
    assert limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=1, now=0.0) is not None


def test_no_limit_configured_keeps_nothing() -> None:
    limiter = _limiter()
    assert limiter.admit(client="addr:x", key=None, group=None, prompt_tokens=1, now=0.0) is None
    assert len(limiter) == 0


def test_counters_survive_a_reload_and_a_new_limit_starts_full() -> None:
    limiter = _limiter(**GROUP)
    for _ in range(2):
        limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=0.0)
    limiter.configure(
        Fairness.model_validate(
            {"groups": {"team": {"keys_env": "UNSET_TEST_KEYS", "requests_per_minute": 2, "tokens_per_minute": 50}}}
        )
    )
    with pytest.raises(RateLimited) as refused:  # the two taken before the reload still count
        limiter.admit(client="key:a addr:x", key="a", group="team", prompt_tokens=1, now=0.0)
    assert refused.value.headers()["x-ratelimit-remaining-tokens"] == "50"


def test_a_flood_of_distinct_clients_is_bounded() -> None:
    """Hostile: more distinct clients than the limiter keeps. The least recently used go first;
    one still in flight is kept."""
    limiter = _limiter(default_limits={"requests_per_minute": 1})
    limiter.MAX_SUBJECTS = 100
    first = limiter.admit(client="addr:busy", key=None, group=None, prompt_tokens=1, now=0.0)
    assert first is not None
    for number in range(10_000):
        each = limiter.admit(client=f"key:{number} addr:x", key=str(number), group=None, prompt_tokens=1, now=0.0)
        assert each is not None
        limiter.finish(each, prompt_tokens=None, answer_tokens=None, now=0.0)
        assert len(limiter) <= 100
    with pytest.raises(RateLimited):  # its bucket was kept while it had a request in flight
        limiter.admit(client="addr:busy", key=None, group=None, prompt_tokens=1, now=0.0)
