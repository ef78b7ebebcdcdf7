"""What the conversations benchmark's cold first turns need, on the engine model in simulated time.

    python scripts/cold_turns.py

The benchmark's ten users each open with a context of about 20,000 tokens, half a second apart,
beside a batch job of 64 requests on the standard engine. This runs the same engines (the
shipped `fast` and `team` profiles, router.sim.engine) without a router or a clock, in
milliseconds:

- the first turns' first tokens when N of them queue on one speculative engine, and when two
  speculative engines share them;
- the batch job's throughput over 80 s on the standard engine when K such turns are served there
  beside it (prefill and a 256-token answer, or the prefill alone).
"""

from __future__ import annotations

from router.sim.engine import Engine, SimRequest
from router.sim.profile import load_profile

PROMPT, ANSWER, GAP = 20_000, 256, 0.5


def first_tokens(count: int, gap: float) -> list[float]:
    """First-token times of `count` cold turns arriving `gap` seconds apart on one `fast` engine."""
    engine = Engine(load_profile("fast"))
    turns: list[SimRequest] = []
    while len(turns) < count or engine.busy:
        while len(turns) < count and len(turns) * gap <= engine.now:
            turn = engine.add(f"c{len(turns)}", prompt_tokens=PROMPT, max_tokens=ANSWER, kind="prose", ignore_eos=True)
            turn.arrival = len(turns) * gap
            turns.append(turn)
        if not engine.busy:
            engine.now = len(turns) * gap
            continue
        engine.step()
    return [round((t.first_token_at or 0.0) - t.arrival, 2) for t in turns]


def batch_throughput(turns: int, answer: int = ANSWER, horizon: float = 80.0, batch: int = 64) -> float:
    """Batch tokens/s over `horizon` on one `team` engine kept at `batch` requests in flight, with
    `turns` cold conversation turns arriving a second apart from the first second."""
    engine = Engine(load_profile("team"))
    tokens = sent = 0
    arrivals = [1.0 + i for i in range(turns)]
    running: list[SimRequest] = []
    while engine.now < horizon:
        running = [r for r in running if r.finished_at is None]
        while len(running) < batch:
            running.append(engine.add(f"b{sent}", prompt_tokens=60, max_tokens=256, kind="prose", ignore_eos=True))
            sent += 1
        while arrivals and arrivals[0] <= engine.now:
            engine.add(f"c{len(arrivals)}", prompt_tokens=PROMPT, max_tokens=answer, kind="prose", ignore_eos=True)
            arrivals.pop(0)
        tokens += sum(e.tokens for e in engine.step() if e.request.id.startswith("b"))
    return tokens / horizon


def main() -> None:
    for count in (10, 5, 4):
        print(f"{count} cold turns {GAP} s apart on one speculative engine: first tokens {first_tokens(count, GAP)}")
    print(f"5 cold turns 1 s apart (two speculative engines sharing ten): worst {max(first_tokens(5, 1.0))} s")
    alone = batch_throughput(0)
    print(f"batch job alone on the standard engine: {alone:.0f} tok/s")
    for turns in (1, 3, 5):
        with_answers, prefill_only = batch_throughput(turns), batch_throughput(turns, answer=1)
        print(
            f"{turns} cold turns served beside it: batch {with_answers / alone:.1%} "
            f"(their prefill alone: {prefill_only / alone:.1%})"
        )


if __name__ == "__main__":
    main()
