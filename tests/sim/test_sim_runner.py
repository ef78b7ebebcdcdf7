"""The engine runner in (scaled) real time: what it does when the machine cannot keep up."""

from __future__ import annotations

import asyncio

from router.sim.profile import load_profile
from router.sim.runner import EngineRunner


def test_a_runner_behind_the_wall_clock_still_lets_the_server_take_requests() -> None:
    """On a busy machine the runner falls behind the wall clock. It must still yield after each
    step: before, it stepped the first request to its end before a second could even arrive, so
    a sweep's round ran its users one after the other and `/metrics` saw nothing running."""

    async def run() -> None:
        # So fast a scale that every step is due at once: the runner is always behind.
        runner = EngineRunner(load_profile("team"), time_scale=1e12)
        task = asyncio.create_task(runner.run())
        try:
            first = runner.submit(prompt_tokens=50, max_tokens=500, kind="prose", ignore_eos=True, min_tokens=0)
            assert (await first.updates.get()).tokens == 1  # its first token
            second = runner.submit(prompt_tokens=50, max_tokens=500, kind="prose", ignore_eos=True, min_tokens=0)
            await second.updates.get()
            assert first.request.finished_at is None, "the first ran to its end before the second arrived"
            assert first.request.generated < 500
            assert runner.lag > 0
        finally:
            task.cancel()

    asyncio.run(run())
