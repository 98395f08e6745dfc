"""``verispec bench suffix --peers``: other servers timed beside verispec on the code-editing
workload, and the goal held against the fastest of them."""

from __future__ import annotations

import pytest

from verispec.bench.presets import suffix


def test_peers_must_be_openai_servers_with_distinct_labels(capsys):
    args = suffix.parse_args(["--peers", "openai:http://127.0.0.1:8081@a,openai:http://127.0.0.1:8082@b"])
    assert [(s.label, s.arg) for s in args.peer_specs] == [("openai:a", "http://127.0.0.1:8081"),
                                                          ("openai:b", "http://127.0.0.1:8082")]
    assert suffix.parse_args([]).peer_specs == []
    for bad in ("ngram", "openai:http://h:1@a,openai:http://h:2@a", "openai:h:1"):
        with pytest.raises(SystemExit):
            suffix.parse_args(["--peers", bad])
        assert "--peers" in capsys.readouterr().err


def test_a_peer_request_is_timed_like_a_verispec_one():
    """Against a live verispec server on the tiny model: the peer's greedy tokens are the engine's,
    and its decode time is its time after the first token."""
    from liveserver import make_server
    from verispec.bench.methods import OpenAIRunner
    from verispec.config import SamplingParams
    from verispec.engine.engine import Engine

    with make_server(api_key=None) as live:
        engine = live.runner.engine
        prompt = engine.target.tokenizer.encode("rewrite this", add_special_tokens=False)
        local = Engine(engine.target, max_model_len=64).generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))
        r = suffix.run_peer(OpenAIRunner(live.url, engine.target.tokenizer), prompt, 10)
    assert r["output_ids"] == local.output_ids and r["metrics"] is None
    assert r["decode_tokens"] == len(local.output_ids) - 1
    assert r["decode_s"] == pytest.approx(r["total_s"] - r["prefill_s"]) and 0 < r["prefill_s"] <= r["total_s"]


def test_the_better_of_suffix_and_ngram_is_held_against_the_fastest_peer():
    from verispec.metrics import SpecMetrics

    decode_s = {"plain": 8.0, "ngram": 4.0, "suffix": 2.0, "openai:mod": 7.0, "openai:simple": 5.0}
    runs = []
    for request, group in enumerate(("round1", "round2")):
        for method, seconds in decode_s.items():
            metrics = None if method.startswith("openai:") else SpecMetrics()
            runs.append({"method": method, "group": group, "request": request, "decode_s": seconds,
                         "decode_tokens": 40, "metrics": metrics, "divergence": None})
    results = suffix.aggregate(runs, list(decode_s))
    args = suffix.parse_args(["--goal-vs-peers", "2.4"])
    peer = results["openai:simple"]["repetitive"]
    assert peer["speedup"] == pytest.approx(8 / 5) and peer["mean_acceptance_length"] is None
    assert peer["identical"] == 2 and peer["decode_tok_s"] == pytest.approx(80 / 10)
    vs = suffix.goals(results, args, ["openai:mod", "openai:simple"])["vs_fastest_peer"]
    assert (vs["ours"], vs["peer"]) == ("suffix", "openai:simple")
    assert vs["ratio"] == pytest.approx(4.0 / 1.6) and vs["goal"] == 2.4 and vs["met"] is True
    assert suffix.goals(results, suffix.parse_args(["--goal-vs-peers", "2.6"]), ["openai:simple"])[
        "vs_fastest_peer"]["met"] is False  # the goal is the caller's
    assert suffix.goals(results, args)["vs_fastest_peer"] == {"ours": "suffix", "peer": None, "ratio": None,
                                                              "goal": 2.4, "met": None}
