"""What the batch tests and scripts/bench_batch_store.py set up alike: a batch's input file, and
the settings of a router whose every backend is one engine (to run as `tests.servers.serve`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import settings_data


def batch_input(count: int, *, prefix: str = "r", url: str = "/v1/chat/completions", **body: Any) -> bytes:
    """`count` lines, `custom_id` `<prefix>-<i>`: the engine sees no custom_id, so the message
    carries it too, and the engine can count the lines it was sent. `body` adds to each request."""
    rows = (
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": url,
            "body": {
                "model": "test-model",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"{prefix}-{i}"}],
                **body,
            },
        }
        for i in range(count)
    )
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def router_config(directory: Path, engine_url: str, *, slots: int, **overrides: Any) -> Path:
    """`directory`/router.yaml: both pools' backends on the engine at `engine_url`, each with
    `slots` requests at once, and `overrides` (`batch={...}`, say) on the tests' settings."""
    data = settings_data(engine_url, engine_url, **overrides)
    for pool in data["pools"].values():
        for backend in pool["backends"].values():
            backend["max_concurrency"] = slots
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "router.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path
