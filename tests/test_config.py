"""Bad input is a clear error: sampling parameters and the speculative config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.speculative.base import DrafterContext
from verispec.speculative.registry import available_methods, build_drafter


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": -3}, "max_tokens must be a positive integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_speculative_config_json_matches_vllm_names():
    cfg = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 6}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 5, 2, 6)


def test_model_without_method_means_draft_model():
    assert SpeculativeConfig.from_dict({"model": "some-draft"}).method == "draft_model"


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown speculative config key.*num_spec_tokens.*valid keys: method"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_spec_tokens": 3})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
        ('{"num_speculative_tokens": 3}', 'needs "method"'),
    ],
)
def test_bad_speculative_config_is_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_unknown_method_lists_valid_methods():
    assert {"draft_model", "ngram"} <= set(available_methods())
    with pytest.raises(ValueError, match="unknown speculative method 'medusa2'; valid methods: .*draft_model.*ngram"):
        build_drafter(SpeculativeConfig(method="medusa2"), DrafterContext(target=None, max_model_len=16))


def test_draft_model_without_model_is_clear_error():
    with pytest.raises(ValueError, match='needs "model"'):
        build_drafter(SpeculativeConfig(method="draft_model"), DrafterContext(target=None, max_model_len=16))


def test_adaptive_is_on_by_default_and_json_can_turn_it_off():
    assert SpeculativeConfig(method="ngram").adaptive is True
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 6, "adaptive": false}')
    assert (cfg.adaptive, cfg.num_speculative_tokens) == (False, 6)
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": "no"})


def _policy_seen(code: str, **extra: str) -> str:
    """What ``code`` prints in a fresh interpreter whose environment has no wait policy or spin
    count but ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_importing_verispec_first_makes_openmp_threads_wait_passively():
    """verispec sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP, unless the user set the
    policy or a spin count (verispec/__init__.py says why)."""
    code = "import os, verispec, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _policy_seen(code) == "PASSIVE"
    assert _policy_seen(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert _policy_seen(code, GOMP_SPINCOUNT="1000") == "None"


def test_programs_started_from_verispec_get_the_users_wait_policy():
    """The passive policy is verispec's own: a program it starts (llama.cpp in a benchmark) gets
    the environment without it, and a policy the user set stays."""
    code = ("import verispec, torch; from verispec.runtime import foreign_env; "
            "print(foreign_env().get('OMP_WAIT_POLICY'))")
    assert _policy_seen(code) == "None"
    assert _policy_seen(code, OMP_WAIT_POLICY="PASSIVE") == "PASSIVE"
