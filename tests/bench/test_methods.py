"""``--methods`` parsing maps onto SpeculativeConfig / GenerationConfig generically; runners time turns."""

from __future__ import annotations

import pytest
import torch

from verispec.bench import methods
from verispec.bench.methods import HFRunner, LlamaCppRunner, hf_generation_options, parse_methods, speculative_config
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.speculative import registry


def test_plain_comes_first_and_duplicates_are_dropped():
    specs = parse_methods("ngram, plain, ngram")
    assert [s.label for s in specs] == ["plain", "ngram"]


def test_options_continue_after_commas_and_map_onto_the_speculative_config():
    specs = parse_methods("ngram@k=6,prompt_lookup_max=3,draft_model:some-draft@k=2")
    assert [s.label for s in specs] == ["plain", "ngram@k=6,prompt_lookup_max=3", "draft_model:some-draft@k=2"]
    assert speculative_config(specs[1]) == SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_max=3)
    assert speculative_config(specs[2]) == SpeculativeConfig(method="draft_model", num_speculative_tokens=2,
                                                            model="some-draft")
    assert speculative_config(specs[0]) is None


def test_a_newly_registered_drafter_is_a_method_without_harness_changes(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "brand_new", lambda config, context: None)
    (spec,) = parse_methods("brand_new@k=3")[1:]
    assert speculative_config(spec).method == "brand_new"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "unknown method 'nope'; valid methods: plain, "),
        ("ngram@bogus=1", "unknown speculative config key(s): bogus"),
        ("ngram@k=0", "num_speculative_tokens must be >= 1"),
        ("prompt_lookup_max=3", "follows no method@"),
        ("plain@k=2", "takes no argument or options"),
        ("draft_model:", "empty argument"),
        ("hf:assisted", "needs an assistant model"),
        ("hf:plain:x", "takes no argument"),
        ("hf:plain@k=2", "option k needs hf:assisted or hf:prompt_lookup"),
        ("hf:prompt_lookup@bogus=1", "not a transformers GenerationConfig field"),
        ("hf:beam", "unknown transformers method"),
        ("llamacpp:beam", "unknown llama.cpp method"),
        ("", "no methods given"),
    ],
)
def test_bad_methods_give_clear_errors(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_methods(text)


def test_unknown_method_error_lists_every_valid_method():
    with pytest.raises(ValueError) as info:
        parse_methods("nope")
    for name in ("ngram", "draft_model", "hf:plain", "hf:assisted:DRAFT", "hf:prompt_lookup", "llamacpp:plain"):
        assert name in str(info.value)


def test_llamacpp_methods_say_when_llama_cpp_python_is_missing(monkeypatch):
    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="needs llama-cpp-python, which is not installed"):
        parse_methods("llamacpp:prompt_lookup@k=4")


def test_hf_options_resolve_k_per_method():
    assisted, lookup, lookup_k = parse_methods("hf:assisted:d@k=5,hf:prompt_lookup,hf:prompt_lookup@k=3")[1:]
    assert hf_generation_options(assisted) == {"num_assistant_tokens": 5}
    assert hf_generation_options(lookup) == {"prompt_lookup_num_tokens": methods.PROMPT_LOOKUP_TOKENS}
    assert hf_generation_options(lookup_k) == {"prompt_lookup_num_tokens": 3}


def tiny_hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def argmax_loop(model, prompt, n):
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_hf_runner_is_greedy_at_t0_and_stops_at_eos():
    model = tiny_hf_model()
    prompt = [3, 5, 7, 9]
    expected = argmax_loop(model, prompt, 6)
    result = HFRunner(model, frozenset(), {}).generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    assert result.output_ids == expected and result.finish_reason == "length"
    assert 0 < result.prefill_s < result.total_s

    eos = expected[2]
    stop_at = expected.index(eos)
    result = HFRunner(model, frozenset([eos]), {}).generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    assert result.output_ids == expected[: stop_at + 1] and result.finish_reason == "stop"


def test_hf_assisted_counts_its_first_round_as_prefill_output():
    model, assistant = tiny_hf_model(), tiny_hf_model()  # same seed: the assistant always agrees
    prompt = [3, 5, 7, 9]
    runner = HFRunner(model, frozenset(), {"num_assistant_tokens": 4}, assistant=assistant)
    result = runner.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert result.output_ids == argmax_loop(model, prompt, 8)
    assert result.first_tokens > 1


class FakeLlama:
    """Stands in for ``llama_cpp.Llama``: yields a fixed token stream, records its arguments."""

    def __init__(self, stream):
        self.stream, self.calls = stream, []

    def set_seed(self, seed):
        self.calls.append(("seed", seed))

    def generate(self, tokens, **kwargs):
        self.calls.append(("generate", list(tokens), kwargs))
        yield from self.stream


def test_llamacpp_runner_stops_at_eos_or_max_tokens_and_samples_purely():
    llm = FakeLlama([4, 5, 6, 2, 7, 8])
    stopped = LlamaCppRunner(llm, frozenset([2])).generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10))
    assert stopped.output_ids == [4, 5, 6, 2] and stopped.finish_reason == "stop"
    capped = LlamaCppRunner(llm, frozenset([2])).generate([1], SamplingParams(temperature=1.0, max_tokens=2, seed=7))
    assert capped.output_ids == [4, 5] and capped.finish_reason == "length"
    assert ("seed", 7) in llm.calls
    kwargs = llm.calls[-1][2]
    assert (kwargs["temp"], kwargs["top_k"], kwargs["top_p"], kwargs["min_p"]) == (1.0, 0, 1.0, 0.0)
    LlamaCppRunner(llm, frozenset([2])).generate([1], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2))
    kwargs = llm.calls[-1][2]
    assert (kwargs["temp"], kwargs["top_k"], kwargs["top_p"], kwargs["min_p"]) == (0.7, 0, 0.9, 0.0)


def test_llamacpp_prompt_lookup_keeps_a_logits_row_per_position(monkeypatch, tmp_path):
    """llama-cpp-python sizes its logits buffer by ``logits_all`` while a draft model makes it
    write a row per position: without logits_all=True a context past 512 tokens crashed a run."""
    import sys
    import types

    from tiny import loaded, tiny_model

    made = []
    fake = types.ModuleType("llama_cpp")
    fake.Llama = lambda **kwargs: made.append(kwargs)
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda **kwargs: ("lookup", kwargs)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: object())
    builder = methods.Builder(loaded(tiny_model(48, seed=0)), 2048, lambda name, q: None, gguf=tmp_path / "m.gguf")
    for spec in parse_methods("llamacpp:plain,llamacpp:prompt_lookup@k=4")[1:]:
        builder.build(spec)
    assert [m["logits_all"] for m in made] == [False, True]
    assert made[1]["n_ctx"] == 2048 and made[1]["draft_model"] == ("lookup", {"num_pred_tokens": 4})


def test_builder_makes_tree_drafters_and_loads_each_draft_once_per_quantization():
    from tiny import loaded, tiny_model

    from verispec.speculative.draft_model import DraftModelDrafter
    from verispec.speculative.draft_tree import TreeDraftModelDrafter

    target = loaded(tiny_model(48, seed=0))
    calls = []

    def load(name, quantization):
        calls.append((name, quantization))
        return loaded(tiny_model(48, seed=1), name=name)

    builder = methods.Builder(target, 256, load)
    specs = parse_methods("plain,draft_model:d@k=3,draft_model:d@k=3,draft_topk=2,num_draft_tokens=5,"
                          "draft_model:d@k=2,quantization=int8")
    drafters = [builder.build(s).engine.drafter for s in specs[1:]]
    assert type(drafters[0]) is DraftModelDrafter
    assert isinstance(drafters[1], TreeDraftModelDrafter)
    assert calls == [("d", "auto"), ("d", "int8")]  # "auto": the default, a GGUF draft on the native kernels


@pytest.mark.parametrize("text, url, label", [
    ("openai:http://127.0.0.1:8080", "http://127.0.0.1:8080", "openai:127.0.0.1:8080"),
    ("openai:http://127.0.0.1:8080/@llama-draft", "http://127.0.0.1:8080", "openai:llama-draft"),
    ("openai:https://user@example.com:443", "https://user@example.com:443", "openai:user@example.com:443"),
])
def test_openai_methods_name_a_server_url_and_an_optional_label(text, url, label):
    spec = parse_methods(text)[1]
    assert (spec.backend, spec.arg, spec.label) == ("openai", url, label)


@pytest.mark.parametrize("text, message", [
    ("openai:127.0.0.1:8080", "expected openai:http://HOST:PORT"),
    ("openai:ftp://x@y", "expected openai:http://HOST:PORT"),
    ("openai:http://h:1@x,k=3", "takes no KEY=VALUE options"),
])
def test_bad_openai_methods_give_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_methods(text)


def test_openai_runner_times_a_live_server_and_gets_its_greedy_tokens():
    """Against a live verispec server on the tiny model: the same prompt ids give the ids the
    engine gives locally (the character tokenizer round-trips text exactly), with a TTFT."""
    from liveserver import make_server
    from verispec.bench.methods import OpenAIRunner
    from verispec.engine.engine import Engine

    with make_server(api_key=None) as live:
        engine = live.runner.engine
        prompt = engine.target.tokenizer.encode("timing a server", add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=12)
        local = Engine(engine.target, max_model_len=64).generate(prompt, params)
        runner = OpenAIRunner(live.url, engine.target.tokenizer)
        assert runner.model == "tiny"
        result = runner.generate(prompt, params)
        again = runner.generate(prompt, params)  # the server's usage says how much it had cached
    assert result.output_ids == local.output_ids and result.finish_reason == local.finish_reason
    assert 0 < result.prefill_s <= result.total_s
    assert result.cached_prompt_tokens == 0
    assert again.cached_prompt_tokens == (len(prompt) - 1 if engine.prefix_caching else 0)


def test_openai_runner_says_when_no_server_answers():
    from verispec.bench.methods import OpenAIRunner

    with pytest.raises(ValueError, match="no OpenAI-compatible server answered"):
        OpenAIRunner("http://127.0.0.1:9", object(), timeout_s=5)
