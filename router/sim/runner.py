"""Drives the engine model in (scaled) real time and hands each request its tokens.

Simulated time runs `time_scale` times faster than the wall clock: a step the model says
lasts 30 ms is slept for 30/scale ms. Figures read off the wall clock are multiplied back by
the scale (`specroute bench --time-scale`). If this process cannot keep up, the lag is
exported (`specroute_sim_lag_seconds`) rather than hidden, and the runner still yields after
every step, so that the server keeps taking requests and answering `/metrics` meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from router.content import ContentKind
from router.sim.engine import Engine, SimRequest
from router.sim.profile import Profile


class Update(NamedTuple):
    """What one step gave one generation: its tokens, and whether it is finished."""

    choice: int
    tokens: int
    finished: bool


@dataclass(eq=False)
class Generation:
    """One request inside the engine, seen from the HTTP side.

    The `n` choices of one HTTP request are `n` generations sharing one queue, told apart by
    their index (as vLLM runs `n > 1` as `n` requests in its engine)."""

    request: SimRequest
    index: int = 0
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)


class EngineRunner:
    def __init__(self, profile: Profile, *, time_scale: float = 1.0, seed: int = 0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = Engine(profile, seed=seed)
        self.time_scale = time_scale
        self.lag = 0.0  # wall seconds the simulation is behind where it should be
        self._generations: dict[SimRequest, Generation] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._wall_origin: float | None = None

    def submit(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        kind: ContentKind,
        ignore_eos: bool,
        min_tokens: int,
        index: int = 0,
        updates: asyncio.Queue[Update] | None = None,
        blocks: tuple[bytes, ...] = (),
        tail: tuple[str, ...] | None = None,
    ) -> Generation:
        if not self.engine.busy:
            # An idle engine's clock catches up with the wall clock before the request arrives.
            self.engine.now = max(self.engine.now, self._sim_now())
        request = self.engine.add(
            f"req-{next(self._ids)}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            kind=kind,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            blocks=blocks,
            tail=tail,
        )
        generation = Generation(request, index, asyncio.Queue() if updates is None else updates)
        self._generations[request] = generation
        self._wake.set()
        return generation

    def abort(self, generation: Generation) -> None:
        self.engine.abort(generation.request)
        self._generations.pop(generation.request, None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._wall_origin = loop.time() - self.engine.now / self.time_scale
        while True:
            if not self.engine.busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            emissions = self.engine.step()
            delay = self._wall_time(self.engine.now) - loop.time()
            self.lag = max(0.0, -delay)
            # Behind the wall clock too, it yields: else it would step to the end of every request
            # before the server reads another one or answers `/metrics` (a busy machine's case).
            await asyncio.sleep(max(0.0, delay))
            for emission in emissions:
                generation = self._generations.get(emission.request)
                if generation is None:
                    continue
                generation.updates.put_nowait(Update(generation.index, emission.tokens, emission.finished))
                if emission.finished:
                    del self._generations[emission.request]

    def _sim_now(self) -> float:
        if self._wall_origin is None:
            return self.engine.now
        return (asyncio.get_running_loop().time() - self._wall_origin) * self.time_scale

    def _wall_time(self, sim_time: float) -> float:
        assert self._wall_origin is not None
        return self._wall_origin + sim_time / self.time_scale
