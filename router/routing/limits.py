"""Limits per key or key group: requests and tokens per minute, requests in flight.

Each limited subject (a key group as a whole, one key of a group, or one client under
`fairness.default_limits`) has a token bucket per rate: full at the limit, refilled at the limit
per minute, one request or token taken per use. Tokens are the prompt's (estimated when the
request arrives, corrected by the engine's `usage`) and the answer's (counted when it is known).
A request that finds a bucket short is refused with 429 (`RateLimited`) and takes nothing.

The buckets outlive a reload (a changed limit keeps the level, within the new size) and are
bounded: at most `MAX_SUBJECTS`; past that the least recently used subject is forgotten first (it
comes back with full buckets). A bucket that has refilled holds nothing worth keeping.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from router.config import Fairness, Quota
from router.errors import RateLimited

_WINDOW = 60.0  # seconds: the limits are per minute


@dataclass(frozen=True, slots=True)
class Rate:
    """Where a bucket stands, for OpenAI's `x-ratelimit-*` headers."""

    limit: int
    remaining: int
    reset: float  # seconds until the bucket is full again


class _Bucket:
    __slots__ = ("level", "limit", "updated")

    def __init__(self, now: float) -> None:
        self.level = 0.0
        self.limit = 0  # the limit it was last filled for (0: none yet)
        self.updated = now

    def refill(self, limit: int, now: float) -> None:
        if not self.limit:
            self.level = float(limit)  # a limit new to this subject starts full
        else:
            self.level = min(float(limit), self.level + (now - self.updated) * limit / _WINDOW)
        self.limit, self.updated = limit, now

    def wait(self, limit: int, need: float) -> float:
        """Seconds until `need` is in the bucket."""
        return max(0.0, round((need - self.level) * _WINDOW / limit, 6))  # no 20.000000001 s

    def rate(self, limit: int) -> Rate:
        return Rate(limit, max(0, math.floor(self.level)), self.wait(limit, limit))


class _Subject:
    __slots__ = ("in_flight", "requests", "tokens")

    def __init__(self, now: float) -> None:
        self.requests = _Bucket(now)
        self.tokens = _Bucket(now)
        self.in_flight = 0


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request within its limits: what to give back when it ends, and the headers to send."""

    subject: str
    quota: Quota
    charged: int  # tokens taken when it arrived (its prompt, estimated)
    headers: dict[str, str]


class Limiter:
    MAX_SUBJECTS = 100_000

    def __init__(self) -> None:
        self._subjects: OrderedDict[str, _Subject] = OrderedDict()
        self._groups: dict[str, Quota] = {}
        self._shared: dict[str, bool] = {}
        self._default = Quota()

    def configure(self, config: Fairness) -> None:
        """The (re)loaded `fairness` section. The counters are kept."""
        self._groups = {name: group for name, group in config.groups.items() if group.limited}
        self._shared = {name: group.shared for name, group in config.groups.items()}
        self._default = config.default_limits

    def admit(
        self, *, client: str, key: str | None, group: str | None, prompt_tokens: int, now: float
    ) -> Admitted | None:
        """Take one request (and its prompt's tokens) from the subject's buckets, or raise
        RateLimited. None: no limit applies to this request."""
        found = self._quota(client, key, group)
        if found is None:
            return None
        subject_name, quota = found
        subject = self._subject(subject_name, now)
        rpm, tpm = quota.requests_per_minute, quota.tokens_per_minute
        need = min(max(prompt_tokens, 1), tpm) if tpm else 0
        if rpm:
            subject.requests.refill(rpm, now)
        if tpm:
            subject.tokens.refill(tpm, now)
        if quota.max_in_flight is not None and subject.in_flight >= quota.max_in_flight:
            raise RateLimited(
                f"Too many requests in flight: limit {quota.max_in_flight}; wait for one to finish.",
                kind="requests",
                retry_after=1,
                headers=_headers(subject, quota),
            )
        if rpm and subject.requests.level < 1:
            wait = subject.requests.wait(rpm, 1)
            raise RateLimited(
                f"Rate limit reached on requests per minute: limit {rpm}. Please try again in {_duration(wait)}.",
                kind="requests",
                retry_after=wait,
                headers=_headers(subject, quota),
            )
        if tpm and subject.tokens.level < need:
            wait = subject.tokens.wait(tpm, need)
            raise RateLimited(
                f"Rate limit reached on tokens per minute: limit {tpm}, requested {need}. "
                f"Please try again in {_duration(wait)}.",
                kind="tokens",
                retry_after=wait,
                headers=_headers(subject, quota),
            )
        if rpm:
            subject.requests.level -= 1
        if tpm:
            subject.tokens.level -= need
        subject.in_flight += 1
        return Admitted(subject_name, quota, need, _headers(subject, quota))

    def finish(self, admitted: Admitted, *, prompt_tokens: int | None, answer_tokens: int | None, now: float) -> None:
        """The request ended: its slot in flight given back, its tokens counted as the engine
        reported them (the estimate stands for a prompt the engine did not report)."""
        subject = self._subjects.get(admitted.subject)
        if subject is None:
            return  # forgotten meanwhile (the bound): nothing to give back
        subject.in_flight = max(0, subject.in_flight - 1)
        tpm = admitted.quota.tokens_per_minute
        if tpm:
            subject.tokens.refill(tpm, now)
            used = (prompt_tokens if prompt_tokens is not None else admitted.charged) + (answer_tokens or 0)
            subject.tokens.level -= used - admitted.charged  # may go below zero: a long answer owes

    def __len__(self) -> int:
        return len(self._subjects)

    def _quota(self, client: str, key: str | None, group: str | None) -> tuple[str, Quota] | None:
        if group is not None and group in self._groups:
            if self._shared[group] or key is None:
                return f"group:{group}", self._groups[group]
            return f"group:{group} {client.split(' ', 1)[0]}", self._groups[group]  # the key's hash
        if group is None and self._default.limited:
            return client, self._default
        return None

    def _subject(self, name: str, now: float) -> _Subject:
        subject = self._subjects.get(name)
        if subject is None:
            if len(self._subjects) >= self.MAX_SUBJECTS:
                self._forget_one()
            subject = self._subjects[name] = _Subject(now)
        else:
            self._subjects.move_to_end(name)
        return subject

    def _forget_one(self) -> None:
        """The least recently used subject with nothing in flight (else the least recent)."""
        for name, subject in self._subjects.items():
            if not subject.in_flight:
                del self._subjects[name]
                return
        self._subjects.popitem(last=False)


def _headers(subject: _Subject, quota: Quota) -> dict[str, str]:
    """OpenAI's rate-limit headers for the limits that apply (`x-ratelimit-*-requests`, `-tokens`)."""
    headers: dict[str, str] = {}
    for kind, limit, bucket in (
        ("requests", quota.requests_per_minute, subject.requests),
        ("tokens", quota.tokens_per_minute, subject.tokens),
    ):
        if limit:
            rate = bucket.rate(limit)
            headers[f"x-ratelimit-limit-{kind}"] = str(rate.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(rate.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = _duration(rate.reset)
    return headers


def _duration(seconds: float) -> str:
    """A wait as OpenAI writes it (Go's duration format): `120ms`, `1s`, `1.5s`, `6m0s`, `1h0m0s`."""
    millis = math.ceil(seconds * 1000)
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
