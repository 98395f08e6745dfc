"""Gemma 3, Gemma 2 and Qwen3 as configurations of the one decoder, on tiny random models.

Their layers are not of the Llama form the native one-call layer runs (q/k norms; Gemma's
sandwich norms, GeGLU, query scale and alternating sliding-window layers; Gemma 2's capped
attention, which runs in PyTorch), so they run the Python layer, here with native Q8_0 projections where the kernels are available. Invariants: every row
of a verify chain and of a tree pass equals a decode step's bit for bit, with a sliding window
shorter than the context (so it cuts into the cache, and into deep trees), and greedy speculative
decoding (chains and trees) reproduces plain greedy decoding token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from tiny import loaded, torch_threads
from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.decoder import Decoder, DecoderConfig, rope_inv_freq
from verispec.models.native import float_activations_, quantize_native_
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter
from verispec.speculative.tree import Tree, tree_layout

VOCAB = 48
WINDOW = 6  # Gemma's sliding window here: shorter than every test's context
GEMMA = dict(architecture="Gemma3ForCausalLM", qk_norm=True, sandwich_norms=True, norm_offset=1.0,
             hidden_act="gelu_pytorch_tanh", embed_scale=True, sliding_window=WINDOW,
             layer_types=("sliding_attention", "full_attention", "sliding_attention"),
             rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=24.0, tie_word_embeddings=True)
GEMMA2 = {**GEMMA, "architecture": "Gemma2ForCausalLM", "qk_norm": False, "rope_local_theta": None,
          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}
QWEN3 = dict(architecture="Qwen3ForCausalLM", qk_norm=True)
ARCHS = {"gemma3": GEMMA, "gemma2": GEMMA2, "qwen3": QWEN3}
PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7, 9, 4, 3, 7, 9, 11, 6]


def tiny(arch: str, native: bool, seed: int = 0) -> Decoder:
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=16, **ARCHS[arch])
    model = Decoder.empty(cfg, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights near 1 (Gemma's 1 + w already folded in)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    if native:
        quantize_native_(model, "int8", keep_dense=False)
        float_activations_(model)
    return model


@pytest.fixture(scope="module", params=[f"{a}-{p}" for a in ARCHS for p in ("python", "native")])
def model(request):
    arch, path = request.param.split("-")
    if path == "native" and not kernels.available():
        pytest.skip("native kernels unavailable (no compiler)")
    with torch_threads(1):
        yield tiny(arch, native=path == "native")


def test_layers_run_the_python_path(model):
    assert not model.config.llama_layers
    assert model._native_layers(torch.zeros(1, 1, 64)) is None


def test_chain_and_tree_rows_equal_decode_steps_bitwise(model):
    with torch_threads(1):
        rnd = random.Random(0)
        prefix_len = 20  # > WINDOW: the window cuts into the cached prefix
        prefix = torch.tensor([[rnd.randrange(VOCAB) for _ in range(prefix_len)]])
        # a chain of decode steps vs one verify pass over the same tokens
        tokens = [rnd.randrange(VOCAB) for _ in range(9)]
        cache = model.new_cache(64)
        model(prefix, torch.arange(prefix_len)[None], cache)
        steps = [model(torch.tensor([[tok]]), torch.tensor([[prefix_len + i]]), cache)[0, 0]
                 for i, tok in enumerate(tokens)]
        cache.truncate(0, prefix_len)
        chain = model(torch.tensor([tokens]), torch.arange(prefix_len, prefix_len + len(tokens))[None], cache)[0]
        assert torch.equal(chain, torch.stack(steps))
        # a tree deeper than the window: each root-to-leaf path as a chain
        tree = Tree((-1, 0, 0, 0, 0, 1, 5, 6, 7, 8, 9, 10, 2))  # siblings first: indices run ahead of depths
        cache.truncate(0, prefix_len)
        layout = tree_layout(tree, prefix_len)
        tree_tokens = [rnd.randrange(VOCAB) for _ in range(len(tree))]
        tree_logits = model(torch.tensor([tree_tokens]), layout.positions[None], cache, attn_mask=layout.mask[None])[0]
        for path in layout.paths.tolist():
            path = [i for i in path if i >= 0]
            cache.truncate(0, prefix_len)
            ids = torch.tensor([[tree_tokens[i] for i in path]])
            rows = model(ids, torch.arange(prefix_len, prefix_len + len(path))[None], cache)[0]
            assert torch.equal(tree_logits[path], rows), path


def test_sliding_window_hides_old_keys(model):
    """Only a sliding-window model forgets: a token WINDOW or more positions back changes
    nothing in its sliding layers, so two prompts that differ only there differ in the global
    layers alone (Gemma) or everywhere (Qwen3, no window)."""
    with torch_threads(1):
        a = [5] + PROMPT[:12]
        b = [6] + PROMPT[:12]
        out = []
        for ids in (a, b):
            cache = model.new_cache(32)
            out.append(model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, num_logits=1)[0, 0])
        assert not torch.equal(out[0], out[1])  # the global layers (or every layer) still see it
    if model.config.layer_types is not None:
        windows = [model.config.window(i) for i in range(model.config.num_layers)]
        assert windows == [WINDOW, None, WINDOW]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, seed=0)


def _generate(model, drafter=None, k=0):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=k, adaptive=False) if k else None
    return Engine(loaded(model), spec, max_model_len=128, drafter=drafter).generate(PROMPT, GREEDY)


def test_greedy_speculative_output_identical_to_plain(model):
    with torch_threads(1):
        plain = _generate(model)
        assert len(plain.output_ids) == GREEDY.max_tokens
        chains = _generate(model, NgramDrafter(1, 3), k=4)
        # another random model of the architecture drafts (chains, then trees)
        arch = {v["architecture"]: k for k, v in ARCHS.items()}[model.config.architecture]
        draft = tiny(arch, native=False, seed=1)
        drafted = _generate(model, DraftModelDrafter(loaded(draft), VOCAB, 128), k=3)
        trees = _generate(model, TreeDraftModelDrafter(loaded(draft), VOCAB, 128, depth=3, topk=2, budget=6), k=3)
    for spec in (chains, drafted, trees):
        assert spec.output_ids == plain.output_ids
        assert spec.metrics.num_draft_tokens > 0
    assert trees.metrics.tree_rounds > 0


def test_gemma3_config_scales_only_the_global_layers_rope():
    """The larger Gemma 3 models scale RoPE linearly on their global layers only (transformers 5
    keeps one set of RoPE parameters per layer type); the local layers keep base 10000."""
    cfg = DecoderConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 512, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None]
    unscaled = DecoderConfig(**{**cfg.__dict__, "rope_scaling": None})
    assert torch.equal(rope_inv_freq(cfg), rope_inv_freq(unscaled) / 8.0)
    assert torch.equal(rope_inv_freq(cfg, local=True), 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16)))
