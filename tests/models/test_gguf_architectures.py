"""Tiny GGUF files of the newer architectures, written as llama.cpp writes them, against transformers.

* Qwen3 (q/k norms, no qkv bias, head_dim from the metadata): transformers loads the GGUF itself
  (``from_pretrained(gguf_file=...)``, dequantized, float32) and is the reference. Its GGUF reader
  does not read ``attention.key_length`` for Qwen3 and takes the config's default head_dim, 128,
  so the file uses that head size.
* Phi-3 (fused ``attn_qkv``, and gate and up in one ``ffn_up``): transformers loads the GGUF.
* Gemma 2 (capped attention scores and logits, sandwich norms, alternating windows): the
  reference is transformers' model on the file's weights, as its GGUF reader drops the caps.
* Mistral, stored as llama.cpp stores it: a ``llama`` file with ``llama.attention.sliding_window``.
  transformers' GGUF reader drops the window (it reads a Llama), so the reference is
  transformers' Mistral on the file's weights, with the window on every layer.
* Llama with Llama 3.x RoPE scaling, stored as llama.cpp stores it: a ``rope_freqs`` tensor of
  per-dimension factors. transformers' GGUF reader drops that tensor (it would run the file
  unscaled), so the reference is transformers' Llama on the file's weights, whose config carries
  the ``llama3`` rope_scaling the tensor was computed from.

* A float GGUF (Llama): every weight matrix, the embedding table (also the tied LM head)
  included, in F16, BF16 or F32 in turn. The kernels run them in float32 (no activation
  quantization), so the native load must equal the dense float32 one up to summation order, and
  it must load with no dense layer and no warning.

Weights are random, in the quantized types the native kernels run that gguf-py can write (Q8_0,
Q5_0, Q4_1; it has no K-quant quantizer), so the default load runs them natively; the dense
float32 load runs the file's values exactly, and is checked against transformers' own model
holding the same weights (float32 summation order only). Both loads are compared with the
reference on teacher-forced logits; greedy speculative decoding of the native model is checked
against plain decoding.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_reference import transformers_on_the_file
from gguf import GGUFWriter
from tokenizers.pre_tokenizers import ByteLevel

from tiny import loaded as engine_model, torch_threads
from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.errors import UnsupportedModelError
from verispec.models.loader import load_model
from verispec.models.native import is_native
from verispec.speculative.ngram import NgramDrafter

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w"]
TOKENS = SPECIALS + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell", "Ġw"]
TOKENS += [f"<|extra_{i}|>" for i in range(-len(TOKENS) % 16)]  # a vocabulary the kernels tile
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
THETA = 500000.0
GEMMA2_WINDOW = 8
MISTRAL_WINDOW = 8
N = 96  # teacher-forced tokens
NATIVE = kernels.available()  # built (or found) at collection, in the real cache, not per test


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    with torch_threads(2):
        yield


def llama3_factors(head_dim: int, scaling: dict) -> np.ndarray:
    """The rope_freqs tensor as llama.cpp's converter computes it (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


FLOAT_TYPES = (Q.F16, Q.BF16, Q.F32)


def write_gguf(path: Path, arch: str, rope_freqs: dict | None = None, float_weights: bool = False,
               window: int | None = None) -> Path:
    """``float_weights``: every 2-D tensor in F16, BF16 and F32 in turn, in place of the types below;
    ``window``: the file states a sliding window (for a llama file: Mistral's)."""
    hidden, ff, layers = 64, 256, 2
    heads, kv_heads, head_dim = (2, 1, 128) if arch == "qwen3" else (4, 2, 16)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(layers)
    writer.add_context_length(16384)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma2":
        writer.add_sliding_window(GEMMA2_WINDOW)
        writer.add_float32("gemma2.attn_logit_softcapping", 5.0)  # small, so the caps bite
        writer.add_float32("gemma2.final_logit_softcapping", 10.0)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen3" else "default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(0)
    matrices = 0

    def add(name: str, *shape: int, qtype: Q = Q.F32, scale: float = 0.3, offset: float = 0.0) -> None:
        nonlocal matrices
        values = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        if float_weights and len(shape) == 2:
            qtype = FLOAT_TYPES[matrices % len(FLOAT_TYPES)]
            matrices += 1
        if qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quantize(values, qtype), raw_dtype=qtype)

    vocab = len(TOKENS)
    add("token_embd.weight", vocab, hidden, qtype=Q.Q8_0, scale=1.0)
    add("output_norm.weight", hidden, scale=0.1, offset=1.0)  # Gemma: stored as 1 + w, as llama.cpp does
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", llama3_factors(head_dim, rope_freqs))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", hidden, scale=0.1, offset=1.0)
        add(p + "ffn_norm.weight", hidden, scale=0.1, offset=1.0)
        if arch == "gemma2":
            add(p + "post_attention_norm.weight", hidden, scale=0.1, offset=1.0)
            add(p + "post_ffw_norm.weight", hidden, scale=0.1, offset=1.0)
        if arch == "phi3":  # fused, as llama.cpp writes Phi-3
            add(p + "attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden, qtype=Q.Q8_0)
        else:
            add(p + "attn_q.weight", heads * head_dim, hidden, qtype=Q.Q5_0)
            add(p + "attn_k.weight", kv_heads * head_dim, hidden, qtype=Q.Q8_0)
            add(p + "attn_v.weight", kv_heads * head_dim, hidden, qtype=Q.Q4_1)
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", head_dim, scale=0.1, offset=1.0)
            add(p + "attn_k_norm.weight", head_dim, scale=0.1, offset=1.0)
        add(p + "attn_output.weight", hidden, heads * head_dim, qtype=Q.Q8_0, scale=0.1)
        if arch == "phi3":  # gate and up in one tensor, gate first
            add(p + "ffn_up.weight", 2 * ff, hidden, qtype=Q.Q5_0)
        else:
            add(p + "ffn_gate.weight", ff, hidden, qtype=Q.Q8_0)
            add(p + "ffn_up.weight", ff, hidden, qtype=Q.Q5_0)
        add(p + "ffn_down.weight", hidden, ff, qtype=Q.Q4_1 if i == 0 else Q.Q5_0, scale=0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ids() -> torch.Tensor:
    return torch.randint(len(SPECIALS), len(TOKENS), (1, N), generator=torch.Generator().manual_seed(1))


def _ours(path: Path, **kw) -> tuple[torch.Tensor, object]:
    model = load_model(path, progress=False, **kw)
    ids = _ids()
    logits = model.model(ids, torch.arange(N)[None], model.model.new_cache(N))[0]
    return logits, model


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _check_greedy_identity(model) -> None:
    prompt = _ids()[0, :20].tolist() * 2  # repeats, so prompt lookup drafts
    params = SamplingParams(temperature=0.0, max_tokens=24)
    spec = SpeculativeConfig(method="given", num_speculative_tokens=4, adaptive=False)
    plain = Engine(engine_model(model.model), max_model_len=128).generate(prompt, params)
    drafted = Engine(engine_model(model.model), spec, max_model_len=128, drafter=NgramDrafter(1, 3)).generate(prompt, params)
    assert drafted.output_ids == plain.output_ids
    assert drafted.metrics.num_draft_tokens > 0


def _check_against_transformers(path: Path, architecture: str, on_gguf: bool = True) -> object:
    """The dense float32 load against transformers' model on the same weights (float32 summation
    order only) and, with ``on_gguf``, against transformers loading the GGUF itself (its own
    reading of the file); the native load's top-1 against the latter (else the former). Returns
    the native load."""
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        dense, loaded = _ours(path, dtype="float32", quantization="none")
        assert loaded.hf_config["architectures"] == [architecture]
        same_weights = transformers_on_the_file(loaded)
        ref = same_weights(_ids()).logits[0]
        exact = (dense - ref).abs().max().item()
        if on_gguf:
            reader = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            ref = reader.eval()(_ids()).logits[0]
    native, loaded = _ours(path)
    assert is_native(loaded.model) == NATIVE
    print(f"\n{architecture}: max |logit diff| {exact:.3g} vs transformers on the same weights; top-1 "
          f"agreement over {N} tokens with transformers on the {'GGUF' if on_gguf else 'same weights'}: "
          f"dense {_agreement(dense, ref):.3f}, native {_agreement(native, ref):.3f}")
    assert exact < 1e-4
    assert (dense - ref).abs().max() < 1e-4  # transformers' own reading of the file: the same weights
    assert _agreement(dense, ref) >= 0.95
    assert _agreement(native, ref) >= 0.9  # random weights: flat logits, int8 activations
    return loaded


def test_qwen3_matches_transformers(tmp_path: Path) -> None:
    loaded = _check_against_transformers(write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3"), "Qwen3ForCausalLM")
    assert loaded.model.config.qk_norm and loaded.model.config.head_dim == 128
    _check_greedy_identity(loaded)


def test_phi3_fused_tensors_match_transformers(tmp_path: Path) -> None:
    loaded = _check_against_transformers(write_gguf(tmp_path / "tiny-phi3.gguf", "phi3"), "Phi3ForCausalLM")
    if NATIVE:  # the fused tensors run as they are, one part each
        assert [len(loaded.model.layers[0].qkv.parts), len(loaded.model.layers[0].gate_up.parts)] == [1, 1]
    _check_greedy_identity(loaded)


def test_gemma2_softcaps_and_window_match_transformers(tmp_path: Path) -> None:
    """Attention and final logit softcapping, sandwich norms, GeGLU, and a window of 8 on every
    other layer, within the 96 teacher-forced tokens. The capped attention runs in PyTorch (the
    native attention kernel has no cap), whose rows may change with the keys a pass spans, so the
    model does not claim pass-invariant rows (no prefix caching). transformers' GGUF reader drops
    the caps in the metadata (it takes Gemma2Config's defaults, 50 and 30), so the reference is
    transformers' model on the file's weights."""
    path = write_gguf(tmp_path / "tiny-gemma2.gguf", "gemma2")
    loaded = _check_against_transformers(path, "Gemma2ForCausalLM", on_gguf=False)
    c = loaded.model.config
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (5.0, 10.0)
    assert [c.window(i) for i in range(2)] == [GEMMA2_WINDOW, None]
    assert not loaded.model.rows_are_pass_invariant()
    _check_greedy_identity(loaded)


def test_a_llama_file_with_a_sliding_window_runs_as_mistral(tmp_path: Path) -> None:
    """A window of 8 on every layer, within the 96 teacher-forced tokens, against transformers'
    MistralForCausalLM on the file's weights; transformers' own reading of the file (a Llama,
    no window) differs from it far more, so the window is what is checked."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "tiny-mistral.gguf", "llama", window=MISTRAL_WINDOW)
    loaded = _check_against_transformers(path, "MistralForCausalLM", on_gguf=False)
    assert loaded.hf_config["sliding_window"] == MISTRAL_WINDOW
    c = loaded.model.config
    assert [c.window(i) for i in range(c.num_layers)] == [MISTRAL_WINDOW] * c.num_layers
    with torch.inference_mode():
        dense, _ = _ours(path, dtype="float32", quantization="none")
        unwindowed = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        full = unwindowed(_ids()).logits[0]
    assert (dense[:MISTRAL_WINDOW] - full[:MISTRAL_WINDOW]).abs().max() < 1e-4  # the window does not bite yet
    assert (dense - full).abs().max() > 1e-2  # and then it does
    _check_greedy_identity(loaded)


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "tiny-llama3.gguf", "llama", rope_freqs=LLAMA3)
    dense, loaded = _ours(path, dtype="float32", quantization="none")
    assert loaded.hf_config["rope_parameters"]["rope_type"] == "llama3"
    for key, value in LLAMA3.items():
        assert loaded.hf_config["rope_parameters"][key] == pytest.approx(value)
    ref_model = transformers_on_the_file(loaded)
    with torch.inference_mode():
        ref = ref_model(_ids()).logits[0]
        unscaled = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        plain_rope = unscaled(_ids()).logits[0]
    diff = (dense - ref).abs().max().item()
    assert diff < 1e-4, diff  # the same weights: float32 summation order only
    # not vacuous: transformers' own GGUF reading (no scaling) differs far more
    assert (plain_rope - ref).abs().max().item() > 100 * max(diff, 1e-6)
    native, loaded = _ours(path)
    print(f"\nllama3 rope: dense max |diff| {diff:.3g}; native top-1 agreement {_agreement(native, ref):.3f}")
    assert _agreement(native, ref) >= 0.95
    _check_greedy_identity(loaded)


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable (no compiler)")
def test_float_weight_matrices_run_on_the_kernels(tmp_path: Path) -> None:
    """F16, BF16 and F32 weight matrices (q and k with llama.cpp's rotary row interleave, which
    the loader undoes on the raw rows) load as native layers, with no dense layer and no warning;
    their float32 products give the dense float32 model's logits up to summation order, and
    greedy speculative output equals plain output."""
    import warnings

    from verispec.models.native import NativeLinear

    path = write_gguf(tmp_path / "tiny-llama-float.gguf", "llama", float_weights=True)
    with torch.inference_mode():
        dense, _ = _ours(path, dtype="float32", quantization="none")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the load warns of any layer left dense
            # float32 throughout, as the dense load (the default load holds the norms' weights in
            # bf16, and the KV cache in float16)
            native, loaded = _ours(path, dtype="float32", kv_cache_dtype="float32")
    model = loaded.model
    layers = [getattr(layer, attr) for layer in model.layers for attr in ("qkv", "o_proj", "gate_up", "down")]
    assert all(isinstance(lin, NativeLinear) for lin in layers + [model.lm_head])
    fmts = {p.fmt for lin in layers + [model.lm_head] for p in lin.parts}
    assert fmts == {kernels.FORMATS[t.name] for t in FLOAT_TYPES}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    rel = ((native - dense).norm() / dense.norm()).item()
    print(f"\nfloat weights: native vs dense float32 logits, relative difference {rel:.3g}")
    assert rel < 1e-5
    assert _agreement(native, dense) == 1.0
    _check_greedy_identity(loaded)


def test_rope_freqs_of_no_known_scaling_are_refused_before_converting(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", "llama", rope_freqs={**LLAMA3, "high_freq_factor": 2.5})
    with pytest.raises(UnsupportedModelError, match="matches no Llama 3 scaling"):
        load_model(path, progress=False)
    assert not any((tmp_path / "home" / d).exists() and any((tmp_path / "home" / d).iterdir()) for d in ("converted", "gguf"))


@pytest.mark.parametrize("arch", ["qwen3moe", "mamba", "clip"])
def test_other_architectures_are_refused_before_converting(tmp_path: Path, arch: str) -> None:
    """Mixture-of-experts, state-space and multimodal files: a clear error from the header."""
    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=rf"unsupported GGUF architecture '{arch}'.*gemma3"):
        load_model(path, progress=False)
    assert not any((tmp_path / "home" / d).exists() and any((tmp_path / "home" / d).iterdir()) for d in ("converted", "gguf"))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_the_written_out_parameter_table_is_transformers_model(tmp_path: Path, arch: str) -> None:
    """``hf_parameter_shapes`` lists what a weightless build of transformers' model lists, in
    order, for each architecture's config as read from a file (tied and untied embeddings, q/k/v
    biases on Qwen2 and on a Llama that states them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verispec.models.gguf_convert import gguf_metadata, hf_parameter_shapes

    if arch in ("qwen2", "gemma3"):  # no synthetic file above: the config of a small one by hand
        model_type = "gemma3_text" if arch == "gemma3" else arch
        configs = [AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        vocab_size=48, tie_word_embeddings=tied, pad_token_id=0)
                   for tied in (True, False)]  # fmt: skip
    else:
        path = write_gguf(tmp_path / f"{arch}.gguf", "llama" if arch == "mistral" else arch,
                          window=MISTRAL_WINDOW if arch == "mistral" else None)
        configs = [AutoConfig.from_pretrained(gguf_metadata(path, progress=False))]
        if arch == "llama":
            biased = {**configs[0].to_dict(), "attention_bias": True, "tie_word_embeddings": True}
            configs.append(AutoConfig.for_model(biased.pop("model_type"), **biased))
    for config in configs:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        expected = [(name, tuple(p.shape)) for name, p in skeleton.named_parameters()]
        if config.tie_word_embeddings:
            expected = [(name, shape) for name, shape in expected if name != "lm_head.weight"]
        assert list(hf_parameter_shapes(config).items()) == expected
