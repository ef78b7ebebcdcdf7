"""Settings from YAML and the environment, and `specroute check-config`."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import main
from router.config import ConfigError, load_settings

EXAMPLE = Path(__file__).parent.parent / "config" / "router.yaml"


def test_example_file_loads() -> None:
    settings = load_settings(EXAMPLE)
    assert set(settings.pools) == {"fast", "team"}
    assert settings.pools["fast"].speculative
    assert not settings.pools["team"].speculative
    assert settings.pool_for("interactive") == "fast"
    assert settings.pool_for("batch") == "team"


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTE_LISTEN__PORT", "9123")
    monkeypatch.setenv("SPECROUTE_POOLS__FAST__QUEUE_SIZE", "7")
    settings = load_settings(EXAMPLE)
    assert settings.listen.port == 9123
    assert settings.pools["fast"].queue_size == 7
    assert settings.pools["fast"].backends["fast-1"].url == "http://10.0.0.11:8000"


def test_config_path_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTE_CONFIG", str(EXAMPLE))
    assert set(load_settings().pools) == {"fast", "team"}


def test_pool_choice_defaults_without_routing_section(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "pools:\n"
        "  std: {speculative: false, backends: {s1: {url: 'http://127.0.0.1:1/v1/'}}}\n"
        "  spec: {speculative: true, backends: {f1: {url: 'http://127.0.0.1:2'}}}\n"
    )
    settings = load_settings(path)
    assert settings.pool_for("interactive") == "spec"
    assert settings.pool_for("batch") == "std"
    assert settings.pools["std"].backends["s1"].url == "http://127.0.0.1:1"


def test_check_config_prints_resolved_settings_with_secrets_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAST_KEY", "sk-upstream-secret")
    monkeypatch.setenv("CLIENT_KEYS", "sk-a,sk-b")
    path = tmp_path / "r.yaml"
    path.write_text(
        "pools:\n"
        "  fast:\n"
        "    speculative: true\n"
        "    backends: {f1: {url: 'http://127.0.0.1:1', api_key_env: FAST_KEY}}\n"
        "classify:\n"
        "  rules: [{name: etl, job: batch, match: {api_key: sk-client-secret}}]\n"
        "auth: {client_keys_env: CLIENT_KEYS}\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sk-upstream-secret" not in out
    assert "sk-client-secret" not in out
    assert "FAST_KEY (set)" in out
    assert "CLIENT_KEYS (2 keys)" in out and "sk-a" not in out
    assert '"max_body_bytes": 4194304' in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pools: {}\n", "pools: "),
        ("pools:\n  fast: {speculative: maybe, backends: {f: {url: 'http://x'}}}\n", "pools.fast.speculative: "),
        ("pools:\n  fast: {speculative: true, backends: {f: {url: 'ftp://x'}}}\n", "pools.fast.backends.f.url: "),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x', max_concurrency: 0}}}\n",
            "pools.fast.backends.f.max_concurrency: ",
        ),
        ("pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}}\nlisten: {prot: 1}\n", "listen.prot: "),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}}\nrouting: {batch_pool: team}\n",
            "no pool named 'team'",
        ),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}, prior_speed: {prose: {0: 50}}}\n",
            "pools.fast.prior_speed: Value error, prose: concurrency 0 must be at least 1",
        ),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}, prior_speed: {code: {4: -1}}}\n",
            "code: tokens/s at 4 must be a positive number",
        ),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}, prior_speed: {code: {}}}\n",
            "code: give",
        ),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}, prior_speed: {text: {1: 9}}}\n",
            "text",
        ),
        (
            "pools:\n  fast: {speculative: true, backends: {f: {url: 'http://x'}}}\nlearn: {prior_weight: -1}\n",
            "learn.prior_weight",
        ),
        ("pools: [\n", "not valid YAML"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_bad_file_exits_non_zero_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 1
    assert expected in capsys.readouterr().err
    with pytest.raises(ConfigError):
        load_settings(path)


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "/nonexistent/router.yaml"]) == 1
    assert "No such file" in capsys.readouterr().err


def test_a_backend_url_with_a_password_is_refused_without_echoing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "userinfo.yaml"
    path.write_text(
        "pools:\n  fast:\n    speculative: true\n    backends:\n"
        "      fast-1: {url: 'http://admin:hunter2@10.0.0.11:8000'}\n"
    )
    assert main(["check-config", str(path)]) == 1
    out = capsys.readouterr()
    assert "pools.fast.backends.fast-1.url" in out.err and "api_key_env" in out.err
    assert "hunter2" not in out.err + out.out
    with pytest.raises(ConfigError) as raised:
        load_settings(path)
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize(
    ("tls", "expected"),
    [
        ("{client_key: /k.pem}", "client_key needs client_cert"),
        ("{ca_bundle: /nonexistent/ca.pem}", "cannot load the CA bundle"),
    ],
)
def test_tls_settings_are_checked_when_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tls: str, expected: str
) -> None:
    path = tmp_path / "tls.yaml"
    path.write_text(f"tls: {tls}\npools:\n  fast:\n    speculative: true\n    backends: {{f: {{url: 'https://e'}}}}\n")
    assert main(["check-config", str(path)]) == 1
    assert expected in capsys.readouterr().err
