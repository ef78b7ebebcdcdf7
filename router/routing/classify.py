"""Pure classification: the facts of one request -> a job class and the reason for it.

The order is fixed: override headers, then configured rules, then heuristics, then the default.
Nothing here does I/O; the caller gathers the facts (including the client's requests in flight).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from router.config import Classify, JobClass, Match, Rule

JOB_CLASSES: tuple[JobClass, ...] = ("interactive", "batch")


@dataclass(frozen=True, slots=True)
class RequestFacts:
    headers: Mapping[str, str]  # lower-cased names
    api_key: str | None = None
    model: str | None = None
    user: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    n: int = 1
    # This client's requests in flight before this one, or its recent peak if that is higher.
    client_load: float = 0


@dataclass(frozen=True, slots=True)
class Classification:
    job: JobClass
    reason: str
    pinned_pool: str | None = None
    rewrite_model: str | None = None


class UnknownOverride(ValueError):
    """An override header whose value names no pool or job class (the HTTP layer answers 400)."""

    def __init__(self, message: str, *, header: str, code: str) -> None:
        super().__init__(message)
        self.header = header
        self.code = code


class Classifier:
    def __init__(self, config: Classify, *, pool_header: str, job_header: str, pools: frozenset[str]) -> None:
        self._rules = config.rules
        self._threshold = config.batch_inflight_threshold
        self._pool_header = pool_header.lower()
        self._job_header = job_header.lower()
        self._pools = pools

    def classify(self, facts: RequestFacts) -> Classification:
        pinned = facts.headers.get(self._pool_header)
        if pinned is not None and pinned not in self._pools:
            raise UnknownOverride(
                f"{self._pool_header}: unknown pool {pinned!r}; pools: {', '.join(sorted(self._pools))}",
                header=self._pool_header,
                code="unknown_pool",
            )
        declared = facts.headers.get(self._job_header)
        if declared is not None:
            if declared not in JOB_CLASSES:
                raise UnknownOverride(
                    f"{self._job_header}: must be 'interactive' or 'batch', not {declared!r}",
                    header=self._job_header,
                    code="unknown_job_type",
                )
            return Classification("batch" if declared == "batch" else "interactive", "header", pinned)

        for rule in self._rules:
            if _matches(rule.match, facts):
                return _from_rule(rule, pinned)

        if facts.client_load >= self._threshold:
            return Classification("batch", "client-in-flight", pinned)
        if facts.n > 1:
            return Classification("batch", "n>1", pinned)
        return Classification("interactive", "default", pinned)


def _from_rule(rule: Rule, pinned: str | None) -> Classification:
    return Classification(rule.job, f"rule:{rule.name}", pinned, rule.rewrite_model)


def _matches(match: Match, facts: RequestFacts) -> bool:
    if match.api_key is not None:
        if facts.api_key is None:
            return False
        # Constant-time: the rule's key is a secret.
        if not hmac.compare_digest(match.api_key.get_secret_value().encode(), facts.api_key.encode()):
            return False
    for name, pattern in match.headers.items():
        if not _glob(pattern, facts.headers.get(name.lower())):
            return False
    if match.user_agent is not None and not _glob(match.user_agent, facts.headers.get("user-agent")):
        return False
    if match.model is not None and not _glob(match.model, facts.model):
        return False
    if match.user is not None and not _glob(match.user, facts.user):
        return False
    for key, pattern in match.metadata.items():
        value = facts.metadata.get(key)
        if not isinstance(value, str) or not fnmatchcase(value, pattern):
            return False
    return True


def _glob(pattern: str, value: str | None) -> bool:
    return value is not None and fnmatchcase(value, pattern)
