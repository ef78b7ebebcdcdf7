"""Microseconds per `snapshot` (router.routing.snapshot) for the peers layout, and its results on
random states, so that two checkouts can be timed and compared side by side.

The peers benchmark's layout (scripts/bench_peers.py): two pools of two backends each, fresh
engine readings, a few recent first tokens, and the lone workload's request: a prompt shorter
than a conversation block, placed before (`Cached` with no prefix held, its home pool known).
`--check N` prints the states of N random pools instead (readings fresh, stale or absent, slots,
other replicas, first tokens waiting, conversations): the same seed gives the same inputs on
any checkout, so two outputs differ only where the snapshots decide differently.

    python scripts/bench_snapshot.py                     # this checkout's venv
    /other/checkout/.venv/bin/python scripts/bench_snapshot.py   # run from outside both checkouts
    python scripts/bench_snapshot.py --check 20000 > after.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import timeit
from typing import Any

from router.backends.engines import Elsewhere, EngineLoad
from router.backends.pools import Pools
from router.config import Settings
from router.routing.conversations import Cached
from router.routing.learn import SpeedModel
from router.routing.snapshot import snapshot

NOW = 1000.0


def _pools(backends: int = 2, *, slots: int = 1024) -> Pools:
    settings = Settings.model_validate(
        {
            "pools": {
                pool: {
                    "speculative": pool == "fast",
                    "queue_size": 4096,
                    "backends": {
                        f"{pool}-{i}": {"url": f"http://127.0.0.1:{9000 + i}", "max_concurrency": slots}
                        for i in range(backends)
                    },
                }
                for pool in ("fast", "team")
            }
        }
    )
    pools = Pools()
    pools.configure(settings.pools, settings.health)
    return pools


def _call(pools: Pools, speeds: SpeedModel, cached: Cached | None, tokens: int | None = 5, **kw: Any) -> Any:
    return snapshot(
        pools,
        speeds,
        now=kw.get("now", NOW),
        stale_after=5.0,
        kv_threshold=0.9,
        acceptance_max_age=300.0,
        tokens=tokens,
        cached=cached,
        load_bound=kw.get("load_bound", 0),
        prefill_token_seconds=5e-5,
        min_gain=0.3,
    )


def bench(number: int, repeat: int) -> None:
    pools = _pools()
    for backend in pools.backends():
        backend.engine.observe(EngineLoad(running=0, waiting=0, kv_usage=0.0, scraped_at=NOW - 0.5))
        for n in range(8):
            backend.first_tokens.waiting(n, NOW - 1.0)
            backend.first_tokens.arrived(n, 0.002 + n * 1e-4)
    speeds = SpeedModel()
    for label, cached in (("lone (conversations on)", Cached(5, {}, home="fast")), ("no conversation", None)):
        timer = timeit.Timer(lambda cached=cached: _call(pools, speeds, cached))
        best = min(timer.repeat(number=number, repeat=repeat))
        print(f"{label}: {best / number * 1e6:.2f} µs per snapshot")


def _random_state(rng: random.Random) -> tuple[Pools, dict[str, Any]]:
    pools = _pools(rng.choice([1, 2, 3]), slots=rng.choice([1, 2, 4, 64]))
    names = [b.name for b in pools.backends()]
    for pool in pools:
        pool.mean_duration = rng.choice([None, 0.5, 3.0])
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            pool._waiters["interactive"].append(None)  # type: ignore[arg-type]  # only counted here
    for backend in pools.backends():
        backend.outlier.healthy = rng.random() < 0.9
        backend.draining = rng.random() < 0.1
        backend.in_flight = rng.choice([0, 0, 1, 2, 5, 70])
        backend.holding.update({n: rng.choice([300, 5000, 30000]) for n in range(rng.randint(0, backend.in_flight))})
        if rng.random() < 0.3:
            backend.batch_work.add(0)
        if rng.random() < 0.2:
            backend.elsewhere = Elsewhere(rng.randint(0, 4), rng.randint(0, 2))
        if rng.random() < 0.3:
            stated = EngineLoad(
                max_concurrency=rng.choice([8.0, 100.0]), kv_cache_tokens=2e6, block_size=16, model_len=32768
            )
            backend.engine.observe(dataclasses.replace(stated, scraped_at=NOW - 50))
        for _ in range(rng.choice([0, 5])):
            backend.engine.prefill.observe(rng.choice([100.0, 1000.0, 5000.0]), rng.random())
        if rng.random() < 0.3:
            age = rng.choice([10, 500])
            backend.engine.observe(EngineLoad(acceptance=0.7, accept_length=3.1, scraped_at=NOW - age))
        if rng.random() < 0.85:

            def maybe(value: float) -> float | None:
                return None if rng.random() < 0.15 else value

            backend.engine.observe(
                EngineLoad(
                    running=maybe(float(rng.choice([0, 1, 3, 64]))),
                    waiting=maybe(float(rng.choice([0, 0, 2]))),
                    queued=maybe(float(rng.choice([0, 2]))),
                    kv_usage=maybe(rng.choice([0.0, 0.3, 0.89, 0.95])),
                    scraped_at=NOW - rng.choice([0.5, 0.5, 4.9, 5.1, 60]),
                    own_in_flight=rng.choice([0, 1, 3]),
                )
            )
        for n in range(rng.choice([0, 3, 12, 20])):
            backend.first_tokens.waiting(n, NOW - rng.random() * 3, rng.choice([0.0, 0.01, 0.2]))
            if rng.random() < 0.7:
                backend.first_tokens.arrived(n, rng.random())
    cached = None
    if rng.random() < 0.6:
        held = {name: rng.choice([64, 640, 6400]) for name in names if rng.random() < 0.4}
        cached = Cached(
            rng.choice([5, 700, 7000]),
            held,
            home=rng.choice([None, "fast", "team"]),
            settled=rng.random() < 0.5,
            last=rng.choice([None, *names]),
        )
    kw = {
        "cached": cached,
        "tokens": rng.choice([None, 5, 700, 40000]),
        "load_bound": rng.choice([0, 2]),
        "now": NOW + rng.choice([0.0, 0.0, 0.01]),
    }
    return pools, kw


def _shown(states: dict[str, Any]) -> str:
    lines = []
    for name, state in states.items():
        fields = {f: getattr(state, f) for f in state.__dataclass_fields__ if f != "speed"}
        speed = state.speed
        if speed:  # Predictions: what it would predict from
            fields["speed"] = (speed._backend, speed._concurrency, speed._gain, speed._fallback)
        lines.append(f"{name} {fields!r}")
    return "\n".join(lines)


def check(count: int, seed: int) -> None:
    rng = random.Random(seed)
    speeds = SpeedModel()
    for n in range(count):
        pools, kw = _random_state(rng)
        print(n, _shown(_call(pools, speeds, **kw)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=20_000, help="snapshots per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings, the best one shown")
    parser.add_argument("--check", type=int, default=0, help="print the states of this many random pools instead")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.check:
        check(args.check, args.seed)
    else:
        bench(args.number, args.repeat)


if __name__ == "__main__":
    main()
