"""`specroute serve` with no configuration: a simulated eight-node cluster behind the router."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import SDK

pytestmark = pytest.mark.e2e  # the demo cluster in its own process


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--port", "0", "--time-scale", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    banner = []
    deadline = time.monotonic() + 60  # a busy machine starts it slowly
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        banner.append(line)
        if match := re.search(r"router at (http://\S+/v1),", line):
            break
    else:
        process.kill()
        process.wait()
        process.stdout.close()
        raise AssertionError("no banner:\n" + "".join(banner))
    try:
        yield match.group(1)
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=15)
        process.stdout.close()
    assert code == 0


def test_openai_client_streams_through_the_embedded_cluster(base_url: str, sdk: SDK) -> None:
    client = sdk(base_url.removesuffix("/v1"))
    raw = client.chat.completions.with_raw_response.create(
        model="glm-5.3-flash",
        messages=[{"role": "user", "content": "Tell me about tides."}],
        max_tokens=64,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert len(text.split()) > 10
    assert raw.headers["x-route-pool"] == "fast"
    batch = client.chat.completions.with_raw_response.create(
        model="glm-5.3-flash",
        messages=[{"role": "user", "content": "Summarise this."}],
        max_tokens=8,
        extra_headers={"X-Job-Type": "batch"},
    )
    assert batch.headers["x-route-pool"] == "team"
    metrics = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    assert 'specroute_completion_tokens_total{backend="fast-1",model="glm-5.3-flash",pool="fast"}' in metrics
    assert [m.id for m in client.models.list()] == ["glm-5.3-flash"]
