"""The drafters by method name: ``SpeculativeConfig.method`` -> a factory.

A factory takes the request-independent configuration and a :class:`DrafterContext` and
returns a :class:`~verispec.speculative.base.Drafter`. The built-in methods are listed here, in
one table; another package adds one with :func:`register_drafter`. The drafter modules import
nothing from this one, so the imports run one way: registry -> drafters -> base.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from verispec.config import SpeculativeConfig
from verispec.models.loader import LoadedModel, load_model
from verispec.speculative.base import Drafter, DrafterContext
from verispec.speculative.draft_model import DraftModelDrafter, check_vocab_compatible
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.eagle import make_eagle_drafter
from verispec.speculative.hybrid import SuffixFirstDrafter
from verispec.speculative.lookahead import make_lookahead_drafter
from verispec.speculative.medusa import make_medusa_drafter
from verispec.speculative.ngram import make_ngram_drafter
from verispec.speculative.suffix import make_suffix_drafter

DrafterFactory = Callable[[SpeculativeConfig, DrafterContext], Drafter]


def make_draft_model_drafter(config: SpeculativeConfig, context: DrafterContext) -> Drafter:
    if not config.model:
        raise ValueError('method "draft_model" needs "model": a bundled name, HF directory or .gguf path')
    target = context.target
    draft = load_model(config.model, device=target.model.device, dtype=target.model.dtype,
                       quantization=config.quantization)
    draft.model.kv_cache_dtype = target.model.kv_cache_dtype  # its cache kept as the target's
    return draft_model_drafter(draft, config, context)


def draft_model_drafter(draft: LoadedModel, config: SpeculativeConfig, context: DrafterContext) -> Drafter:
    """The chain or tree drafter that ``config`` asks for, over an already loaded draft model,
    with suffix decoding first if ``config.enable_suffix_decoding``.

    Callers that run several configurations on one draft model (the benchmark harness) load it
    once and build each drafter here; every drafter keeps its own KV cache.
    """
    if config.enable_suffix_decoding:
        fallback = draft_model_drafter(draft, dataclasses.replace(config, enable_suffix_decoding=False), context)
        return SuffixFirstDrafter(make_suffix_drafter(config), fallback, config.suffix_decoding_min_score)
    check_vocab_compatible(context.target, draft)
    vocab = context.target.model.config.vocab_size
    if config.is_tree:
        return TreeDraftModelDrafter(
            draft, vocab, context.max_model_len, topk=config.speculative_eagle_topk, budget=config.tree_budget,
            children=config.tree_children, choices=config.speculative_token_tree,
            depth=config.num_speculative_tokens, num_slots=context.max_num_seqs,
            draft_vocab_size=config.draft_vocab_size, draft_head_quantization=config.draft_head_quantization,
        )
    return DraftModelDrafter(draft, vocab, context.max_model_len, context.max_num_seqs, config.draft_vocab_size,
                             config.draft_head_quantization)


_REGISTRY: dict[str, DrafterFactory] = {
    "draft_model": make_draft_model_drafter,
    "eagle": make_eagle_drafter,
    "eagle3": make_eagle_drafter,  # vLLM's method name
    "lookahead": make_lookahead_drafter,
    "medusa": make_medusa_drafter,
    "ngram": make_ngram_drafter,
    "suffix": make_suffix_drafter,
}


def register_drafter(method: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Add a method: ``@register_drafter("mine")`` over a factory."""
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[method] = factory
        return factory

    return wrap


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def check_method(method: str) -> None:
    """Raise a clear error, listing the valid methods, if ``method`` is not registered."""
    if method not in _REGISTRY:
        raise ValueError(
            f"unknown speculative method {method!r}; valid methods: {', '.join(available_methods())}"
        )


def build_drafter(config: SpeculativeConfig, context: DrafterContext) -> Drafter:
    check_method(config.method)
    return _REGISTRY[config.method](config, context)
