"""`specroute sim fit`: a profile's speed, derived from a sweep measured on a real engine.

In a round where every user is decoding, one engine step gives each of the c sequences E
tokens (E = 1 without speculation; with it, the accepted guesses plus one), so a step lasts
t(c) = E / per_user_speed(c). The step model is linear in its costs for a given expert share,
so the costs follow from a non-negative least-squares fit of t(c) over the sweep's rounds.
The prefill cost per token comes from the one-user round's first-token time. Capacity (KV cache,
sequences) and speculation settings are taken from the base profile.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from router.sim.profile import Profile, load_profile
from router.sim.replay import replay_round


def expected_tokens_per_step(profile: Profile, kind: str) -> float:
    spec = profile.speculation
    if spec is None:
        return 1.0
    a = spec.acceptance["code" if kind == "code" else "prose"]
    return sum(a**i for i in range(spec.num_tokens + 1))  # 1 + a + a² + ... + a^k


def fit_profile(sweep: dict[str, Any], base: Profile, *, name: str | None = None) -> Profile:
    kind = sweep.get("kind", "prose")
    answer = int(sweep.get("answer_tokens", 512))
    rounds = [r for r in sweep["rounds"] if r.get("per_user_tps") and r["users"] <= base.max_num_seqs]
    if len(rounds) < 2:
        raise ValueError("the sweep needs at least two rounds with a per-user speed")
    prompt = float(sweep.get("prompt_tokens") or 64)
    spec = base.speculation
    k = spec.num_tokens if spec else 0
    gain = expected_tokens_per_step(base, kind)
    p = base.step.expert_share_per_token

    rows, steps = [], []
    for r in rounds:
        c = r["users"]
        tokens = (k + 1) * c
        row = [1.0, 1 - (1 - p) ** tokens, tokens, c, c * (prompt + answer / 2)]
        extra = 0.0
        if spec is not None:
            extra = spec.draft_s * k + spec.draft_token_s * k * c + spec.accepted_token_s * (gain - 1) * c
        rows.append(row)
        steps.append(gain / r["per_user_tps"] - extra)
    costs = _nnls(np.array(rows), np.array(steps))
    base_s, expert_s, token_s, sequence_s, context_s = (float(x) for x in costs)

    one = min(rounds, key=lambda r: r["users"])
    step_one = float(np.array(rows[rounds.index(one)]) @ costs)
    ttft = one.get("median_ttft") or one.get("worst_ttft") or step_one
    prefill_token_s = max(0.0, (float(ttft) - step_one) / prompt)

    step = base.step.model_copy(
        update={
            "base_s": base_s,
            "expert_s": expert_s,
            "token_s": token_s,
            "sequence_s": sequence_s,
            "context_s": context_s,
            "prefill_token_s": prefill_token_s,
        }
    )
    return base.model_copy(
        update={
            "name": name or f"{base.name}-fitted",
            "description": f"Fitted by `specroute sim fit` from {sweep.get('target', 'a sweep')}, base {base.name}.",
            "model": sweep.get("model") or base.model,
            "step": step,
        }
    )


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


def main(sweep_path: str, *, base: str, name: str | None, out: str | None) -> int:
    sweep = json.loads(Path(sweep_path).read_text())
    profile = fit_profile(sweep, load_profile(base), name=name)
    kind = sweep.get("kind", "prose")
    print(f"{'users':>5} {'measured tok/s':>15} {'model tok/s':>12} {'measured worst TTFT':>20} {'model':>8}")
    for r in sweep["rounds"]:
        model = replay_round(profile, r["users"], kind, answer_tokens=int(sweep.get("answer_tokens", 512)))
        print(
            f"{r['users']:>5} {r.get('per_user_tps') or 0:>15.1f} {model.per_user_tps:>12.1f} "
            f"{r.get('worst_ttft') or 0:>19.2f}s {model.worst_ttft:>7.2f}s"
        )
    text = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False)
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
    else:
        print(text)
    return 0
