"""The command line rejects bad input with a clear message and exit code 2, before loading."""

from __future__ import annotations

import pytest

from verispec.cli import build_parser, main, speculative_config_from_args


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in"),
        (["--top-p", "1.01"], "top_p must be in"),
        (["--top-k", str(2**31)], "top_k must be -1, 0 (disabled) or a positive integer up to 2147483647"),
        (["--seed", str(2**64)], "seed must be in [-9223372036854775808, 9223372036854775807]"),
        (["--presence-penalty", "2.5"], "presence_penalty must be in [-2.0, 2.0]"),
        (["--repetition-penalty", "0"], "repetition_penalty must be in [0.01, 100.0]"),
        (["--min-tokens", "300"], "min_tokens must be in [0, max_tokens=256]"),
        (["--speculative-config", '{"method": "ngram", "bogus": 1}'], "unknown speculative config key"),
        (["--speculative-method", "nope"], "unknown speculative method 'nope'"),
    ],
)
def test_generate_bad_input_exits_with_clear_message(capsys, extra, message):
    code = main(["generate", "no-such-model-anywhere", "hello", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_kv_cache_dtype_is_checked_before_loading(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "no-such-model-anywhere", "hello", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "no-such-model-anywhere", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    # With replicas the setting is taken (tests/server/test_ray_routing.py follows it into each
    # replica's engine); this model does not exist, so serving stops at the model lookup.
    assert main(["serve", "no-such-model-anywhere", "--replicas", "2", "--kv-cache-dtype", "float32"]) == 2
    assert "not a bundled model name" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-num-seqs", "0"], "invalid serve settings: --max-num-seqs: Input should be greater than or equal"),
        (["--threads", "0"], "--threads: Input should be greater than or equal to 1"),
        (["--port", "70000"], "--port: Input should be less than or equal to 65535"),
        (["--request-timeout", "-1"], "--request-timeout must be >= 0 (0: no limit)"),
        (["--speculative-method", "nope"], "--speculative-config: unknown speculative method 'nope'"),
    ],
)
def test_serve_bad_input_exits_with_clear_message_naming_the_flag(capsys, extra, message):
    assert main(["serve", "no-such-model-anywhere", *extra]) == 2
    assert message in capsys.readouterr().err


def test_empty_prompt_is_rejected(capsys):
    assert main(["generate", "no-such-model-anywhere", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_unknown_model_lists_bundled_names(capsys):
    assert main(["generate", "no-such-model-anywhere", "hello"]) == 2
    err = capsys.readouterr().err
    assert "qwen2.5-coder-1.5b-instruct" in err and "smollm2-135m-instruct" in err


def test_shorthand_flags_override_the_json_config():
    args = build_parser().parse_args([
        "generate", "m", "p", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--num-speculative-tokens", "6",
    ])
    cfg = speculative_config_from_args(args)
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 6)


def test_speculative_model_shorthand_means_draft_model():
    args = build_parser().parse_args(["generate", "m", "p", "--speculative-model", "d"])
    cfg = speculative_config_from_args(args)
    assert (cfg.method, cfg.model) == ("draft_model", "d")


def test_models_list_names_all_bundled_models(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in out


def test_no_adaptive_flag_restores_fixed_k():
    args = build_parser().parse_args(["generate", "m", "p", "--speculative-method", "ngram", "--no-adaptive"])
    assert speculative_config_from_args(args).adaptive is False
    args = build_parser().parse_args(["generate", "m", "p", "--speculative-method", "ngram"])
    assert speculative_config_from_args(args).adaptive is True


def parsed_spec(*flags: str):
    return speculative_config_from_args(build_parser().parse_args(["generate", "m", "p", *flags]))


def test_speculation_is_on_by_default_with_suffix_decoding_under_the_adaptive_controller():
    for command in (["generate", "m", "p"], ["serve", "m"]):
        cfg = speculative_config_from_args(build_parser().parse_args(command))
        assert (cfg.method, cfg.num_speculative_tokens, cfg.adaptive) == ("suffix", 8, True)
    assert (parsed_spec("--num-speculative-tokens", "3").method, parsed_spec("--num-speculative-tokens", "3")
            .num_speculative_tokens) == ("suffix", 3)
    assert parsed_spec("--no-adaptive").adaptive is False


def test_no_speculation_opts_out_and_refuses_other_speculative_flags():
    assert parsed_spec("--no-speculation") is None
    with pytest.raises(ValueError, match="--no-speculation cannot be combined with --speculative-model"):
        parsed_spec("--no-speculation", "--speculative-model", "d")


def test_a_draft_model_runs_with_suffix_decoding_first_unless_told_otherwise():
    assert parsed_spec("--speculative-model", "d").enable_suffix_decoding is True
    cfg = parsed_spec("--speculative-config", '{"model": "d", "enable_suffix_decoding": false}')
    assert (cfg.method, cfg.enable_suffix_decoding) == ("draft_model", False)
    assert parsed_spec("--speculative-method", "ngram").method == "ngram"
