"""`specroute sim fit`: a profile fitted to what an engine measured, and how well it reproduces it.

From one or more `specroute bench sweep` files (one per content kind), with the engine's own
`/metrics` as the sweep recorded them where the target was an engine, it fits what decides a
split of nodes:
- speculation: the guesses per step and the acceptance per content kind, from the engine's
  speculation counters (else the base profile's);
- how many requests run at once before the rest wait: the engine's peak running in a round that
  had waiting requests, else read from the first-token waits (a round that waited shows waves
  one answer apart); with the stated KV cache this sizes each request's reservation;
- per-user speed against concurrency: the step costs, by non-negative least squares over the
  rounds' step times at the concurrency that ran (not the users that asked);
- the prefill rate: the base's prefill costs scaled to the rounds' first-token times.
Then every round is replayed on the fitted profile. A figure off by more than the tolerance
(first tokens: or by more than `TTFT_ALLOWANCE`) makes the fit poor, and a poor fit is not written
unless forced (docs/planning.md).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from router.content import CONTENT_KINDS, ContentKind
from router.prompts import chat_prompt_tokens, prompts
from router.sim.engine import Engine
from router.sim.profile import Profile, Speculation, load_profile
from router.sim.replay import replay_round
from router.sim.sweep import Sweep

TOLERANCE = 0.15
# A first token this close to the measured one (seconds of wall clock, times the sweep's time scale)
# is right whatever the share: below it, the client's own path (HTTP, tokenizing) dominates.
TTFT_ALLOWANCE = 0.05
# Guesses per step that no engine's drafter makes: counters saying more are no reading of one engine.
MAX_GUESSES = 64


@dataclass(frozen=True, slots=True)
class Check:
    kind: ContentKind
    users: int
    figure: str
    measured: float
    fitted: float
    allowance: float = 0.0  # seconds a first token may be off whatever the share

    @property
    def error(self) -> float:
        return (self.fitted - self.measured) / self.measured if self.measured else math.inf

    @property
    def ok(self) -> bool:
        if abs(self.error) <= TOLERANCE:
            return True
        return "first token" in self.figure and abs(self.fitted - self.measured) <= self.allowance


@dataclass(frozen=True, slots=True)
class Fitted:
    profile: Profile
    checks: tuple[Check, ...]
    notes: tuple[str, ...]  # where each part of the profile came from

    @property
    def poor(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def fit(
    sweeps: list[dict[str, Any]],
    base: Profile,
    *,
    name: str | None = None,
    kv_cache_tokens: int | None = None,
) -> Fitted:
    measured = [Sweep.of(s) for s in sweeps]
    if sum(len(s.rounds) for s in measured) < 2:
        raise ValueError("the sweeps need at least two rounds with a per-user speed and no errors")
    notes: list[str] = []
    stated = kv_cache_tokens or next((s.kv_cache_tokens for s in measured if s.kv_cache_tokens), None)
    capacity = stated or base.kv_cache_tokens
    notes.append(f"KV cache {capacity} tokens: " + ("as the engine states it" if stated else "the base profile's"))
    speculation = _speculation(measured, base, notes)
    profile = base.model_copy(update={"kv_cache_tokens": capacity, "speculation": speculation})

    running = _running_cap(measured)
    profile = _with_cap(profile, running, measured)
    profile = _fit_speed(profile, measured, running)
    profile = _fit_prefill(profile, measured)
    if running is not None and not any(r.engine and s.waited(r) for s in measured for r in s.rounds):
        # Read off the first-token waits: the neighbours of the estimate, judged by replaying.
        candidates = range(max(1, running - 2), running + 3)
        running = min(candidates, key=lambda n: _wait_error(_with_cap(profile, n, measured), measured))
        profile = _fit_speed(_with_cap(profile, running, measured), measured, running)
    notes.append(
        f"{running} requests run at once, then the rest wait (kv_overhead_tokens {profile.kv_overhead_tokens})"
        if running is not None
        else "no round waited: at least as many requests fit as the largest round asked"
    )
    sources = ", ".join(sorted({s.source for s in measured if s.source})) or "a sweep"
    profile = profile.model_copy(
        update={
            "name": name or f"{base.name}-fitted",
            "description": f"Fitted by `specroute sim fit` from {sources}, base {base.name}.",
        }
    )
    return Fitted(profile, tuple(_checks(profile, measured)), tuple(notes))


def accepted_chance(mean_accepted: float, k: int) -> float:
    """The chance `a` that each next guess is right, given the mean accepted per draft of k
    guesses: a + a² + ... + a^k = mean_accepted (the simulator's model of acceptance)."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid**i for i in range(1, k + 1)) < mean_accepted:
            low = mid
        else:
            high = mid
    return round((low + high) / 2, 4)


def _speculation(measured: list[Sweep], base: Profile, notes: list[str]) -> Speculation | None:
    read = [(s.kind, r.engine) for s in measured for r in s.rounds if r.engine is not None]
    engine = [(kind, e) for kind, e in read if _counted(e)]
    if len(engine) < len(read):
        notes.append(f"speculation: {len(read) - len(engine)} rounds' counters left out (went back, or do not add up)")
    if not engine:
        notes.append("speculation: the base profile's (no engine metrics in the sweep)")
        return base.speculation
    drafts = {kind: sum(e.get("drafts", 0.0) for k, e in engine if k == kind) for kind in CONTENT_KINDS}
    if not any(drafts.values()):
        notes.append("no speculation: the engine drafted nothing")
        return None
    draft_tokens = sum(e.get("draft_tokens", 0.0) for _, e in engine)
    k = max(1, round(draft_tokens / sum(drafts.values())))
    acceptance = dict(base.speculation.acceptance) if base.speculation else {}
    for kind, count in drafts.items():
        if count:
            accepted = sum(e.get("accepted_tokens", 0.0) for k_, e in engine if k_ == kind)
            acceptance[kind] = accepted_chance(accepted / count, k)
            notes.append(f"speculation: {k} guesses a step, {kind} acceptance {acceptance[kind]:.3f} (engine)")
    for kind in CONTENT_KINDS:
        if kind not in acceptance:  # not measured and not in the base: as the kind measured
            acceptance[kind] = next(a for a in acceptance.values())
            notes.append(f"speculation: {kind} acceptance not measured, taken as the other kind's")
    # The drafter's costs are this engine's own: folded into the step costs fitted below, not
    # taken from a base that may be another engine (its costs could exceed this one's steps).
    return Speculation(num_tokens=k, draft_s=0.0, draft_token_s=0.0, accepted_token_s=0.0, acceptance=acceptance)


def _counted(engine: dict[str, Any]) -> bool:
    """Whether a round's speculation counters are one engine's: none went back, a draft guessed
    1 to `MAX_GUESSES` tokens (10⁷ took the fit hours), none accepted beyond those guessed."""
    drafts, guessed, accepted = (float(engine.get(name, 0.0)) for name in ("drafts", "draft_tokens", "accepted_tokens"))
    return 0 <= accepted <= guessed and drafts <= guessed <= MAX_GUESSES * drafts


def _running_cap(measured: list[Sweep]) -> int | None:
    """How many requests ran at once in rounds that had others waiting, or None if none waited."""
    from_engine = [
        int(r.engine["peak_running"])
        for s in measured
        for r in s.rounds
        if r.engine and int(r.engine.get("peak_running", 0)) > 0 and s.waited(r)
    ]  # a reading that saw nothing running (a round too short for it) says nothing of the cap
    if from_engine:
        return max(from_engine)
    estimates = []
    for s in measured:
        for r in s.rounds:
            if s.waited(r) and r.worst_ttft:
                waves = max(1, round(r.worst_ttft / (s.answer_tokens / r.per_user_tps)))
                estimates.append(max(1, round(r.users / (waves + 1))))
    if not estimates:
        return None
    # Never fewer than an engine reading saw running at once; as many as the largest round: no cap.
    seen = max((int(r.engine.get("peak_running", 0)) for s in measured for r in s.rounds if r.engine), default=0)
    running = max(round(statistics.median(estimates)), seen)
    return None if running >= max(r.users for s in measured for r in s.rounds) else running


def _with_cap(profile: Profile, running: int | None, measured: list[Sweep]) -> Profile:
    """The profile with each request reserving the KV that lets `running` of the sweep's run at
    once (None: at least the largest round)."""
    length = max(s.prompt_tokens + s.answer_tokens for s in measured)
    most = max(r.users for s in measured for r in s.rounds)
    capacity = profile.kv_cache_tokens
    if running is None:
        if capacity / (length + profile.kv_overhead_tokens) >= most:
            return profile
        overhead = max(0, math.floor(capacity / most - length))
    else:
        overhead = max(0, math.floor(capacity / (running + 0.5) - length))
    return profile.model_copy(update={"kv_overhead_tokens": overhead})


def _gain(profile: Profile, kind: ContentKind) -> float:
    spec = profile.speculation
    if spec is None:
        return 1.0
    a = spec.acceptance[kind]
    return sum(a**i for i in range(spec.num_tokens + 1))  # 1 + a + a² + ... + a^k


def _fit_speed(profile: Profile, measured: list[Sweep], running: int | None) -> Profile:
    spec = profile.speculation
    k = spec.num_tokens if spec else 0
    p = profile.step.expert_share_per_token
    rows = []
    for s in measured:
        gain = _gain(profile, s.kind)
        for r in s.rounds:
            c = min(r.users, running or r.users, profile.max_num_seqs)
            tokens = (k + 1) * c
            rows.append([1.0, 1 - (1 - p) ** tokens, tokens, c, c * (s.prompt_tokens + s.answer_tokens / 2)])
            extra = 0.0
            if spec is not None:
                extra = spec.draft_s * k + spec.draft_token_s * k * c + spec.accepted_token_s * (gain - 1) * c
            # Relative errors: each row divided by its step time, so one-user rounds weigh as much.
            seconds = gain / r.per_user_tps - extra
            rows[-1] = [x / seconds for x in rows[-1]]
    costs = _nnls(np.array(rows), np.ones(len(rows)))
    base_s, expert_s, token_s, sequence_s, context_s = (float(x) for x in costs)
    step = profile.step.model_copy(
        update={
            "base_s": base_s,
            "expert_s": expert_s,
            "token_s": token_s,
            "sequence_s": sequence_s,
            "context_s": context_s,
        }
    )
    return profile.model_copy(update={"step": step})


def _fit_prefill(profile: Profile, measured: list[Sweep]) -> Profile:
    """Scale the base's prefill costs so that the rounds' median first tokens come out right."""
    rounds = [(s, r) for s in measured for r in s.rounds if r.median_ttft and not s.waited(r)]
    if not rounds:
        return profile

    def scaled(factor: float) -> Profile:
        cost = profile.step
        step = cost.model_copy(
            update={
                "prefill_token_s": cost.prefill_token_s * factor,
                "prefill_context_s": cost.prefill_context_s * factor,
                "prefill_request_s": cost.prefill_request_s * factor,
            }
        )
        return profile.model_copy(update={"step": step})

    def error(factor: float) -> float:
        candidate = scaled(factor)
        return sum((_median_first_token(candidate, r.users, s) - (r.median_ttft or 0.0)) ** 2 for s, r in rounds)

    grid = [10 ** (x / 8) for x in range(-24, 25)]  # 0.001 to 1000
    best = min(grid, key=error)
    low, high = best / 10 ** (1 / 8), best * 10 ** (1 / 8)
    for _ in range(12):  # golden-section search between the best grid point's neighbours
        a, b = high - (high - low) / 1.618, low + (high - low) / 1.618
        if error(a) < error(b):
            high = b
        else:
            low = a
    return scaled((low + high) / 2)


def _median_first_token(profile: Profile, users: int, sweep: Sweep) -> float:
    """A round's median first token, stepping only until every request has one."""
    engine = Engine(profile)
    texts = prompts(sweep.kind)
    requests = [
        engine.add(
            f"r{i}",
            prompt_tokens=round(sweep.prompt_tokens) or chat_prompt_tokens([texts[i % len(texts)]]),
            max_tokens=sweep.answer_tokens,
            kind=sweep.kind,
            ignore_eos=True,
        )
        for i in range(users)
    ]
    while any(r.first_token_at is None for r in requests) and engine.busy:
        engine.step()
    return statistics.median((r.first_token_at or engine.now) - r.arrival for r in requests)


def _wait_error(profile: Profile, measured: list[Sweep]) -> float:
    total = 0.0
    for s in measured:
        for r in s.rounds:
            if s.waited(r) and r.worst_ttft:
                replayed = _replay(profile, r.users, s)
                total += ((replayed.worst_ttft - r.worst_ttft) / r.worst_ttft) ** 2
    return total


def _replay(profile: Profile, users: int, sweep: Sweep) -> Any:
    return replay_round(
        profile, users, sweep.kind, answer_tokens=sweep.answer_tokens, prompt_tokens=round(sweep.prompt_tokens)
    )


def _checks(profile: Profile, measured: list[Sweep]) -> list[Check]:
    checks = []
    for s in measured:
        for r in s.rounds:
            replayed = _replay(profile, r.users, s)
            pairs = [
                ("per-user tok/s", r.per_user_tps, replayed.per_user_tps),
                ("total tok/s", r.total_tps, replayed.total_tps),
                ("median first token", r.median_ttft, replayed.median_ttft),
                ("worst first token", r.worst_ttft, replayed.worst_ttft),
            ]
            allowance = TTFT_ALLOWANCE * s.time_scale
            checks += [Check(s.kind, r.users, f, m, v, allowance) for f, m, v in pairs if m]
    return checks


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best feasible subset, exactly."""
    best, best_error = np.zeros(a.shape[1]), math.inf
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            x, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
            if (x < 0).any():
                continue
            error = float(np.sum((a[:, columns] @ x - b) ** 2))
            if error < best_error:
                best_error = error
                best = np.zeros(a.shape[1])
                best[list(columns)] = x
    return best


def table(fitted: Fitted) -> str:
    lines = [f"{'kind':<6} {'users':>5} {'figure':<20} {'measured':>10} {'fitted':>10} {'error':>8}"]
    for c in fitted.checks:
        unit = " s" if "first token" in c.figure else ""
        lines.append(
            f"{c.kind:<6} {c.users:>5} {c.figure:<20} {c.measured:>8.2f}{unit:2} {c.fitted:>8.2f}{unit:2} "
            f"{c.error:>+7.1%}{'' if c.ok else '  POOR'}"
        )
    return "\n".join(lines)


def main(
    sweep_paths: list[str],
    *,
    base: str,
    name: str | None,
    out: str | None,
    kv_cache_tokens: int | None = None,
    force: bool = False,
) -> int:
    sweeps = [json.loads(Path(path).read_text()) for path in sweep_paths]
    fitted = fit(sweeps, load_profile(base), name=name, kv_cache_tokens=kv_cache_tokens)
    print(table(fitted))
    print("\n".join(f"- {note}" for note in fitted.notes))
    poor = fitted.poor
    if poor:
        worst = max(poor, key=lambda c: abs(c.error))
        message = (
            f"POOR FIT: {len(poor)} of {len(fitted.checks)} figures are off by more than {TOLERANCE:.0%} "
            f"(first tokens: and by more than {TTFT_ALLOWANCE} s of wall clock); the worst, {worst.kind} "
            f"{worst.users} users {worst.figure}: {worst.fitted:.2f} against {worst.measured:.2f} measured."
        )
        if not force:
            print(f"{message}\nThe profile is not written (--force writes it anyway).", file=sys.stderr)
            return 2
        print(f"WARNING: {message}\nWritten anyway (--force): plans made on it inherit these errors.", file=sys.stderr)
        fitted = Fitted(
            fitted.profile.model_copy(
                update={"description": fitted.profile.description + f" POOR FIT, forced: {message}"}
            ),
            fitted.checks,
            fitted.notes,
        )
    text = yaml.safe_dump(fitted.profile.model_dump(mode="json"), sort_keys=False)
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
    else:
        print(text)
    return 0
