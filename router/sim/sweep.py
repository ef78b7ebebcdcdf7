"""What a `specroute bench sweep` measured, as `specroute sim fit` reads it: rounds of users at once."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from router.content import CONTENT_KINDS, ContentKind
from router.prompts import chat_prompt_tokens, prompts


@dataclass(frozen=True, slots=True)
class MeasuredRound:
    users: int
    per_user_tps: float
    total_tps: float | None
    median_ttft: float | None
    worst_ttft: float | None
    engine: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Sweep:
    kind: ContentKind
    answer_tokens: int
    prompt_tokens: float
    kv_cache_tokens: int | None
    source: str
    time_scale: float
    rounds: tuple[MeasuredRound, ...]

    @classmethod
    def of(cls, data: dict[str, Any]) -> Sweep:
        kind = data.get("kind", "prose")
        if kind not in CONTENT_KINDS:
            raise ValueError(f"kind {kind!r}: prose or code")
        rounds = tuple(
            MeasuredRound(
                users=int(r["users"]),
                per_user_tps=float(r["per_user_tps"]),
                total_tps=r.get("total_tps"),
                median_ttft=r.get("median_ttft"),
                worst_ttft=r.get("worst_ttft"),
                engine=r.get("engine"),
            )
            for r in data["rounds"]
            if r.get("per_user_tps") and not r.get("errors") and int(r.get("users", 0)) >= 1
        )
        answer = int(data.get("answer_tokens", 512))
        prompt = data.get("prompt_tokens") or statistics.fmean(chat_prompt_tokens([t]) for t in prompts(kind))
        stated = data.get("kv_cache_tokens")
        source, scale = str(data.get("target", "")), float(data.get("time_scale") or 1.0)
        return cls(kind, answer, float(prompt), int(stated) if stated else None, source, scale, rounds)

    def waited(self, r: MeasuredRound) -> bool:
        """Whether some of the round's requests waited for others to finish before they started."""
        if r.engine is not None and int(r.engine.get("peak_running", 0)) > 0:
            return int(r.engine.get("peak_waiting", 0)) > 0 and int(r.engine["peak_running"]) < r.users
        # Without the engine's word (a round too short for a reading to see it running): a first
        # token later than half an answer's duration.
        return (r.worst_ttft or 0.0) > 0.5 * self.answer_tokens / r.per_user_tps
