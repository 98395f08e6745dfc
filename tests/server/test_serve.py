"""``verispec serve``: where the API key comes from, what it guards, and the warning for an open server."""

from __future__ import annotations

import http.client
import json
import logging
import urllib.request

import openai
import pytest

from liveserver import make_app, make_server
from verispec.cli import api_key_from_args, build_parser, main, server_settings_from_args
from verispec.server.config import ServerConfig


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


def test_the_key_can_guard_metrics_and_docs_too_but_never_health():
    """``--api-key-for-metrics-and-docs``: every route but /health asks for the key (by default
    only /v1 routes do, as in vLLM: test_api.py)."""
    args = build_parser().parse_args(["serve", "m", "--api-key", "k", "--api-key-for-metrics-and-docs"])
    assert server_settings_from_args(args)["api_key_for_metrics_and_docs"] is True
    assert not server_settings_from_args(build_parser().parse_args(["serve", "m"]))["api_key_for_metrics_and_docs"]
    with make_server(api_key="k", api_key_for_metrics_and_docs=True) as live:
        def status(path: str, key: str | None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            conn.close()
            if response.status == 401:
                assert json.loads(body)["error"]["type"] == "authentication_error"
                assert response.getheader("WWW-Authenticate") == "Bearer"
            return response.status

        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
            assert status(path, None) == 401, path
            assert status(path, "guess") == 401, path
            assert status(path, "k") == 200, path
        assert status("/health", None) == 200
        doc = json.loads(urllib.request.urlopen(urllib.request.Request(
            live.url + "/openapi.json", headers={"Authorization": "Bearer k"}), timeout=30).read())
        assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
        assert "401" in doc["paths"]["/metrics"]["get"]["responses"]
        assert "security" not in doc["paths"]["/health"]["get"]


def test_guarding_metrics_and_docs_without_a_key_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    with pytest.raises(ValueError, match="needs an API key"):
        ServerConfig(model="m", api_key_for_metrics_and_docs=True).resolved_api_key()
    assert ServerConfig(model="m", api_key_for_metrics_and_docs=True).resolved_api_key({"VERISPEC_API_KEY": "e"}) == "e"
    # before any model loads: this one does not exist
    assert main(["serve", "no-such-model-anywhere", "--api-key-for-metrics-and-docs"]) == 2
    assert "needs an API key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs an api_key"):
        make_app(api_key=None, api_key_for_metrics_and_docs=True)
