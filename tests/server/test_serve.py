"""``verispec serve``: where the API key comes from, and the warning for an open server."""

from __future__ import annotations

import logging

import openai
import pytest

from liveserver import make_server
from verispec.cli import api_key_from_args, build_parser, main


def key_of(argv: list[str], environ: dict[str, str]) -> str | None:
    return api_key_from_args(build_parser().parse_args(["serve", "m", *argv]), environ)


def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text("  file-key\n")
    env = {"VERISPEC_API_KEY": "env-key"}
    assert key_of(["--api-key", "flag-key"], env) == "flag-key"
    assert key_of(["--api-key-file", str(path)], env) == "file-key"
    assert key_of([], env) == "env-key"
    assert key_of([], {}) is None and key_of([], {"VERISPEC_API_KEY": ""}) is None


def test_a_bad_key_source_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        key_of(["--api-key-file", str(empty)], {})
    with pytest.raises(SystemExit):
        key_of(["--api-key", "a", "--api-key-file", str(empty)], {})
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["serve", "m", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize(("host", "env", "warned"), [
    ("0.0.0.0", {}, True),
    ("::", {}, True),
    ("my-host.example", {}, True),
    ("0.0.0.0", {"VERISPEC_API_KEY": "k"}, False),
    ("127.0.0.1", {}, False),
    ("::1", {}, False),
    ("localhost", {}, False),
])
def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, caplog, host, env, warned):
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="verispec.server.serve"):
        # The warning comes before the model loads; this model does not exist, so serve stops there.
        assert main(["serve", "no-such-model-anywhere", "--host", host]) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "verispec.server.serve"]
    assert bool(warnings) == warned, warnings
    if warned:
        assert f"serving on {host} without an API key" in warnings[0]


def test_a_key_from_the_environment_guards_a_live_server():
    key = key_of([], {"VERISPEC_API_KEY": "from-the-env"})
    with make_server(api_key=key) as live:
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="from-the-env", max_retries=0, timeout=60)
        assert [m.id for m in good.models.list().data] == ["tiny"]
        bad = openai.OpenAI(base_url=live.url + "/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
