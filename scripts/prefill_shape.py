"""How a real engine's prefill time depends on the uncached and the cached part of a prompt.

    python scripts/prefill_shape.py http://127.0.0.1:8102/v1 MODEL [--repeats 3]

Sends completions of `max_tokens: 1` whose prompts are token ids (exact lengths): a prompt of
C tokens first (it is then cached), then the same C tokens followed by U new ones. The time of
the second is the prefill of U tokens beside C cached ones. Prints one JSON line per point and
the engine's prefix-cache counters before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def counters(client: httpx.Client, base: str) -> dict[str, float]:
    text = client.get(base.removesuffix("/v1") + "/metrics").text
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
    values = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def timed(client: httpx.Client, base: str, model: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    response = client.post(
        base + "/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    response.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(7)
    with httpx.Client(timeout=120) as client:
        print(json.dumps({"before": counters(client, args.base)}))
        timed(client, args.base, args.model, [rng.randrange(10, 2000) for _ in range(64)])  # warm-up
        for cached in (0, 256, 512, 1024, 1536):
            for uncached in (128, 256, 512, 1024, 1536):
                if cached + uncached > 1900:
                    continue
                times = []
                for _ in range(args.repeats):
                    head = [rng.randrange(10, 2000) for _ in range(cached)]
                    if cached:
                        timed(client, args.base, args.model, head)
                    tail = [rng.randrange(10, 2000) for _ in range(uncached)]
                    times.append(timed(client, args.base, args.model, head + tail))
                print(json.dumps({"cached": cached, "uncached": uncached, "seconds": statistics.median(times)}))
        print(json.dumps({"after": counters(client, args.base)}))


if __name__ == "__main__":
    main()
