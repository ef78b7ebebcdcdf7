"""`specroute plan`: the splits, the record's scaling, the recommendation's rule, and one plan
replayed through the router on simulated clusters."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from router.bench.plan import Figures, Outcome, Split, recommend, splits
from router.bench.replay import _job, bursts, scaled, synthetic
from router.cli import main
from router.record import Served
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from tests.servers import ServerThread
from tests.timing import too_busy_to_time


def test_every_split_of_the_nodes_in_whole_engines() -> None:
    fast, team = load_profile("fast"), load_profile("team")
    assert [(s.fast_nodes, s.team_nodes) for s in splits(8, fast, team)] == [(8, 0), (4, 4), (0, 8)]
    assert [(s.fast, s.team) for s in splits(12, fast, team)] == [(3, 0), (2, 1), (1, 2), (0, 3)]
    two = team.model_copy(update={"nodes": 2})
    assert [(s.fast_nodes, s.team_nodes) for s in splits(6, fast, two)] == [(4, 2), (0, 6)]
    assert splits(3, fast, team) == []


def _entry(at: float, job: str = "batch", **changes: object) -> Served:
    return replace(Served(at, job, "prose", 64, 512, 200, client=f"c-{job}"), **changes)  # type: ignore[arg-type]


def test_scaling_the_record_doubles_or_halves_one_class_over_the_same_span() -> None:
    record = [_entry(float(t)) for t in range(10)] + [_entry(t + 0.5, "interactive") for t in range(0, 10, 2)]
    doubled = scaled(record, batch=2)
    batch = [e.at for e in doubled if e.job == "batch"]
    assert len(batch) == 20 and batch[:4] == [0.0, 0.5, 1.0, 1.5] and max(batch) <= 9.0
    assert [e for e in doubled if e.job == "interactive"] == [e for e in record if e.job == "interactive"]
    halved = scaled(record, batch=0.5, interactive=0)
    assert [e.at for e in halved] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert scaled(record) == sorted(record, key=lambda e: e.at)


def test_a_burst_the_router_took_in_one_after_another_is_replayed_at_once() -> None:
    wave = [_entry(0.004 * n) for n in range(124)] + [_entry(0.55, "interactive")]  # stamped over 0.55 s
    later = [_entry(0.75, "interactive"), _entry(5.0, "interactive")]  # after a pause: as recorded
    assert [e.at for e in bursts(wave + later, gap=0.1)] == [0.0] * 125 + [0.75, 5.0]
    stream = [_entry(0.05 * n) for n in range(100)]  # steady, 20 a second: bursts of at most a second
    moved = bursts(stream, gap=0.1, window=1.0)
    assert len({e.at for e in moved}) == 5 and max(a.at - b.at for a, b in zip(stream, moved, strict=True)) <= 1.0
    assert bursts(stream, gap=0) == stream
    assert [(e.job, e.client) for e in bursts(wave, gap=0.1)] == [(e.job, e.client) for e in wave]


def test_a_synthetic_mix_has_the_requests_asked_for() -> None:
    mix = synthetic(interactive_users=4, interactive_every=10, batch_in_flight=20, batch_every=2, duration=60)
    interactive = [e for e in mix if e.job == "interactive"]
    assert len(interactive) == 24 and len({e.client for e in interactive}) == 4
    batch = [e for e in mix if e.job == "batch"]
    assert len(batch) == 20 + 29 and {e.client for e in batch} == {"batch"}
    assert [e.at for e in mix] == sorted(e.at for e in mix)


def test_a_replayed_request_is_the_recorded_one() -> None:
    job = _job(_entry(0.0, declared=True, kind="code"))
    assert (job.kind, job.max_tokens, job.prompt_tokens, job.label) == ("code", 512, 64, "batch")
    assert job.headers == {"X-Job-Type": "batch"} and job.api_key == "replay-c-batch"
    assert _job(_entry(0.0, "interactive")).headers == {}


def test_an_exported_line_reads_as_the_recorded_one() -> None:
    entry = _entry(12.5, declared=True, conversation="abc")
    assert Served.parse_any(json.dumps(entry.as_dict())) == entry
    assert Served.parse_any(entry.line()) == entry
    assert Served.parse_any('{"at": 1}') is None


def _figures(*, within: float = 1.0, speed: float | None = 50.0, tps: float = 500.0) -> Figures:
    return Figures(10, 0, 0.1, 0.2, 0.3, speed, within, tps, 100.0)


def _outcome(fast: int, team: int, interactive: Figures | None, batch: Figures | None) -> Outcome:
    return Outcome(Split(fast, team, 4 * fast, 4 * team), interactive, batch)


@pytest.mark.parametrize(
    ("outcomes", "chosen", "said"),
    [
        # All meet the target and give the batch at least 80 % of the best: the fastest users decide.
        ([(2, 0, _figures(speed=55), _figures(tps=500)), (1, 1, _figures(speed=57), _figures(tps=420)),
          (0, 2, _figures(speed=30), _figures(tps=510))], (1, 1), "stream fastest"),
        # The fastest users' split costs the batch job more than 20 %: not chosen.
        ([(1, 1, _figures(speed=57), _figures(tps=400)), (0, 2, _figures(speed=30), _figures(tps=510))],
         (0, 2), "batch 510 tok/s"),
        # A split under 95 % within the target is out, whatever it gives the batch.
        ([(2, 0, _figures(within=0.5), _figures(tps=900)), (1, 1, _figures(), _figures(tps=500))],
         (1, 1), "8 speculative + 0 standard: under 95%"),
        # None meets it: the closest.
        ([(2, 0, _figures(within=0.5), None), (1, 1, _figures(within=0.8), None)], (1, 1), "comes closest (80%)"),
        # Batch only: the most batch throughput.
        ([(2, 0, None, _figures(tps=300)), (0, 2, None, _figures(tps=600))], (0, 2), "batch 600 tok/s"),
    ],
)  # fmt: skip
def test_the_recommendation_follows_its_rule(
    outcomes: list[tuple[int, int, Figures | None, Figures | None]], chosen: tuple[int, int], said: str
) -> None:
    best, reason = recommend([_outcome(*o) for o in outcomes], ttft_target=3.0)
    assert (best.split.fast, best.split.team) == chosen
    assert said in reason


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_plan_replays_a_record_on_each_split_and_recommends_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four nodes: all speculative or all standard. Two interactive users beside a batch job of
    40 requests at once: the speculative engine holds 23 at a time, so the batch job's wait pushes
    the interactive first tokens past the target there, and the standard engine is recommended."""
    record = tmp_path / "traffic.jsonl"
    mix = synthetic(interactive_users=2, interactive_every=20, batch_in_flight=40, batch_every=0, duration=40,
                    answer_tokens=256)  # fmt: skip
    record.write_text("".join(json.dumps(e.as_dict()) + "\n" for e in mix))
    out = tmp_path / "plan"
    args = ["plan", "--record", str(record), "--nodes", "4", "--time-scale", "5", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| 4 speculative + 0 standard |" in printed and "| 0 speculative + 4 standard |" in printed
    data = json.loads((out / "plan.json").read_text())
    by_label = {s["label"]: s for s in data["splits"]}
    speculative, standard = by_label["4 speculative + 0 standard"], by_label["0 speculative + 4 standard"]
    for split in (speculative, standard):
        assert split["interactive"]["requests"] == 4 and split["batch"]["requests"] == 40
        assert split["interactive"]["errors"] == split["batch"]["errors"] == 0
    assert (out / "plan.png").stat().st_size > 0 and f"Recommended: {data['recommended']}" in printed
    if busy := too_busy_to_time():  # first tokens read off the wall clock, five times over
        pytest.skip(busy)
    # 40 at once on an engine that runs 23: the rest wait for an answer to end on the speculative
    # one, and so do the interactive requests that come while they wait.
    assert speculative["batch"]["completion"] > 1.25 * standard["batch"]["completion"]
    assert speculative["interactive"]["within_target"] < 0.95 <= standard["interactive"]["within_target"]
    assert data["recommended"] == "0 speculative + 4 standard"


@pytest.mark.e2e
def test_bench_replay_sends_the_record_and_reports_each_class(tmp_path: Path) -> None:
    """What `plan` predicts, measured: the same record sent to a target (here one simulated engine)."""
    team = load_profile("team")
    record = tmp_path / "traffic.jsonl"
    mix = synthetic(interactive_users=2, interactive_every=5, batch_in_flight=6, batch_every=0, duration=10,
                    answer_tokens=32)  # fmt: skip
    record.write_text("".join(json.dumps(e.as_dict()) + "\n" for e in mix))
    with ServerThread(create_sim_app(team, time_scale=10)) as engine:
        args = ["bench", "replay", "--base-url", engine.url + "/v1", "--model", team.model, "--record", str(record),
                "--time-scale", "10", "--out", str(tmp_path / "replayed")]  # fmt: skip
        assert main(args) == 0
    data = json.loads((tmp_path / "replayed" / "replay.json").read_text())
    assert (data["interactive"]["requests"], data["batch"]["requests"]) == (4, 6)
    assert data["interactive"]["errors"] == data["batch"]["errors"] == 0
    assert data["batch"]["tokens_per_s"] > 0 and data["interactive"]["ttft_p50"] is not None
