"""The generated references (docs/reference/) against the code, the example settings and a live
router: a setting or metric added without regenerating them, or without a description, fails."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from router import reference
from router.config import Settings
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, serve

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config" / "router.yaml"
ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?P<type>.*?) \| (?P<third>.*?) \| (?P<text>.*) \|$", re.MULTILINE)


def _rows(page: str) -> dict[str, re.Match[str]]:
    return {row["key"]: row for row in ROW.finditer((ROOT / "docs" / "reference" / page).read_text())}


@pytest.mark.parametrize("page", sorted(reference.pages()))
def test_the_generated_pages_are_current(page: str) -> None:
    written = (ROOT / "docs" / page).read_text()
    assert written == reference.pages()[page], f"docs/{page} is stale: run scripts/docs-reference"


def test_every_setting_has_a_description() -> None:
    sections = list(reference.sections())
    assert [prefix for prefix, model in sections if prefix and not model.__doc__] == []
    settings = [setting for prefix, model in reference.sections() for setting in reference.settings_of(model, prefix)]
    assert [setting.key for setting in settings if not (setting.field.description or "").strip()] == []


def test_the_reference_has_a_row_for_every_setting() -> None:
    documented = {key.replace("<name>", "*") for key in _rows("settings.md")}
    documented -= {key for key in documented if key.startswith("classify.rules[]")}
    assert documented == set(reference.leaves())


def _example_keys(text: str) -> set[str]:
    """The keys config/router.yaml sets, and those it shows commented out (`# key: value`), with
    the names of pools, backends and key groups as `*` and a list's items not looked into."""
    uncommented = re.sub(r"^(\s*)# (?=\s*[a-z_]+:(\s|$))", r"\1", text, flags=re.MULTILINE)
    keys: set[str] = set()
    leaves = set(reference.leaves())

    def walk(node: object, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for name, value in node.items():
            key = f"{prefix}{name}"
            if any(leaf.startswith(f"{key}.*.") for leaf in leaves):  # a map of sections, by name
                for item in value.values():
                    walk(item, f"{key}.*.")
            elif key in leaves or not isinstance(value, dict):
                keys.add(key)
            else:
                walk(value, f"{key}.")

    walk(yaml.safe_load(uncommented), "")
    return keys


def test_the_example_settings_show_every_setting() -> None:
    """Each setting is in config/router.yaml, set or commented out, and nothing else is."""
    assert _example_keys(EXAMPLE.read_text()) == set(reference.leaves())
    Settings(**yaml.safe_load(EXAMPLE.read_text()))


def test_the_private_names_the_generator_reads_still_exist() -> None:
    """prometheus_client lists neither collectors nor label names in public (router.reference)."""
    registry = CollectorRegistry()
    counter = Counter("probe", "A probe.", ["a"], registry=registry)
    assert list(registry._collector_to_names) == [counter]
    assert counter._labelnames == ("a",)


@pytest.mark.e2e
def test_the_metrics_reference_is_what_a_live_router_serves(tmp_path: Path) -> None:
    documented = _rows("metrics.md")
    engine = FakeEngine(metrics="vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
    with ServerThread(engine.app()) as upstream:
        config = tmp_path / "router.yaml"
        pools = {
            "fast": {"speculative": True, "backends": {"fast-1": {"url": upstream.url}}},
            "team": {"speculative": False, "backends": {"team-1": {"url": upstream.url}}},
        }
        config.write_text(yaml.safe_dump({"pools": pools, "scrape": {"interval": 0.1}}))
        with serve(config) as (_, url):
            with openai.OpenAI(base_url=url + "/v1", api_key="none") as client:
                stream = client.chat.completions.create(
                    model="test-model", stream=True, messages=[{"role": "user", "content": "hi"}]
                )
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            exposition = httpx.get(url + "/metrics", timeout=10).text
    live = {family.name: family for family in text_string_to_metric_families(exposition)}
    # prometheus_client writes each counter's and histogram's creation time as a gauge of its own.
    created = {name for name in live if name.endswith("_created") and name.removesuffix("_created") in live}
    assert {live[name.removesuffix("_created")].type for name in created} <= {"counter", "histogram"}
    live = {name: family for name, family in live.items() if name not in created}
    names = {name + ("_total" if family.type == "counter" else ""): name for name, family in live.items()}
    assert set(names) == set(documented)
    for exposed, name in names.items():
        family, row = live[name], documented[exposed]
        assert (family.type, " ".join(family.documentation.split())) == (row["type"], row["text"].replace("\\|", "|"))
        labels = {label for sample in family.samples for label in sample.labels} - {"le", "quantile"}
        if family.samples:
            assert labels == set(re.findall(r"`([^`]+)`", row["third"])), exposed
