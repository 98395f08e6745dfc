"""Tiny random models and a toy tokenizer for engine tests (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from verispec.models.decoder import Decoder, DecoderConfig

LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


class ToyTokenizer:
    """Token i decodes to one character; enough for the detokenizer and stop strings."""

    def __init__(self, vocab: int, eos: int) -> None:
        self.vocab, self.eos = vocab, eos

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if (skip_special_tokens and i == self.eos) else LETTERS[i % len(LETTERS)] for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab)}


def tiny_model(vocab: int = 48, seed: int = 0, layers: int = 2, dtype=torch.bfloat16, noise_from=None,
               noise: float = 0.0) -> Decoder:
    """A random Qwen2-style decoder; ``noise_from`` makes a perturbed copy of another model."""
    cfg = DecoderConfig(
        architecture="Qwen2ForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=128,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, rope_theta=10000.0,
    )
    model = Decoder.empty(cfg, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if noise_from is not None:
                src = dict(noise_from.named_parameters())[name]
                p.copy_(src + noise * torch.randn(p.shape, generator=gen).to(p.dtype))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def bigram(model: Decoder) -> Decoder:
    """``model`` with every layer's attention output zeroed, in place: each next token then
    depends on the last token alone. Its greedy answers are a function of the last token, so what
    a learned drafter learns from some rows carries over to others, as with a real model (a fully
    random tiny model is chaotic: a head only memorises its training rows)."""
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.zero_()
    return model


def loaded(model: Decoder, eos: int = -1, name: str = "tiny") -> SimpleNamespace:
    """Something shaped like ``verispec.models.loader.LoadedModel`` for the engine."""
    tok = ToyTokenizer(model.config.vocab_size, eos)
    tokenizer = SimpleNamespace(hf=tok, decode=tok.decode, eos_token_ids=frozenset([eos]) if eos >= 0 else frozenset())
    return SimpleNamespace(model=model, tokenizer=tokenizer, name=name)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch CPU threads, then restore the previous count. Tiny models run fastest
    on one thread, and far faster on a busy machine (two threads spinning against other
    processes cost 40x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sampled_rows(decoder, n: int, length: int, seed: int, greedy: bool = False) -> torch.Tensor:
    """``n`` sequences from ``decoder`` after random two-token prompts: sampled at T = 1, or
    greedy (the target's own answers, what self-distillation trains on)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = decoder.config.vocab_size
    rows = torch.randint(vocab, (n, 2), generator=gen)
    cache = decoder.new_cache(length, num_slots=n)
    logits = decoder(rows, torch.arange(2).expand(n, -1), cache, num_logits=1)
    while rows.shape[1] < length:
        if greedy:
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1, generator=gen)
        rows = torch.cat([rows, nxt], dim=1)
        logits = decoder(nxt, torch.full((n, 1), rows.shape[1] - 1), cache)
    return rows
