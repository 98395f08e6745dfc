"""A draft model that scores part of its vocabulary (``draft_vocab_size``) leaves the output the
target's: the kept ids' logits are the full head's bit for bit, every other id gets -inf (q = 0
there), and verification is exact for any q. So does a draft head requantized to Q4_1
(``draft_head_quantization``), whose logits differ from the full head's. The sampled distribution
with a cut draft and with a requantized head is tested in tests/engine/test_distribution.py."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny import loaded, tiny_model
from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.quant import quantize_
from verispec.speculative.base import DrafterContext
from verispec.speculative.draft_model import (DraftModelDrafter, DraftVocabulary, bundled_draft_head_quantization,
                                              bundled_draft_vocab_size)
from verispec.speculative.registry import draft_model_drafter

VOCAB = 64
PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (no compiler)")


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1)


@pytest.fixture(scope="module", params=["dense", "native"])
def draft(request, target):
    """A draft close to the target, with a dense bf16 head or the native kernels' Q8_0 one."""
    return close_draft(target, native=request.param == "native")


def close_draft(target, native: bool):
    model = tiny_model(vocab=VOCAB, seed=2, noise_from=target, noise=0.15)
    if native:
        if not kernels.available():
            pytest.skip("native kernels unavailable (no compiler)")
        model = quantize_(model, "int4", native=True)
    return model


def kept_mask(vocab: DraftVocabulary, size: int) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    for a, b in vocab.ranges:
        mask[a:b] = True
    return mask


@needs_kernels
def test_a_native_head_keeps_whole_tiles_and_the_special_tokens():
    model = quantize_(tiny_model(vocab=VOCAB, seed=2), "int4", native=True)
    vocab = DraftVocabulary(model, 20, special_ids=[50, 63, 99], target_vocab=VOCAB)  # 99: past the vocabulary
    assert vocab.ranges == [(0, 32), (48, 64)]
    assert vocab.size == 48


def test_a_dense_head_keeps_exactly_the_ids_asked_for():
    vocab = DraftVocabulary(tiny_model(vocab=VOCAB, seed=2), 20, special_ids=[63, 50, 19], target_vocab=VOCAB)
    assert vocab.ranges == [(0, 20), (50, 51), (63, 64)]
    assert vocab.size == 22


def test_kept_logits_are_the_full_heads_bit_for_bit_and_the_rest_minus_infinity(draft):
    vocab = DraftVocabulary(draft, 24, special_ids=[60], target_vocab=VOCAB)
    x = torch.randn(5, draft.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(draft.dtype)
    full = draft.logits(x)  # [5, V]
    cut = vocab.expand(vocab(x))  # [5, V]
    keep = kept_mask(vocab, VOCAB)
    assert vocab(x).shape == (5, vocab.size)
    assert torch.equal(cut[:, keep], full[:, keep])
    assert torch.isneginf(cut[:, ~keep]).all()


def test_no_kept_id_lies_past_the_targets_vocabulary():
    vocab = DraftVocabulary(tiny_model(vocab=VOCAB, seed=2), 8, special_ids=[62], target_vocab=40)
    assert vocab.ranges == [(0, 8)]  # id 62 has no place in a target of 40 ids
    logits = torch.arange(8.0)[None]
    out = vocab.expand(logits)
    assert out.shape == (1, 40)
    assert torch.equal(out[0, :8], logits[0])
    assert torch.isneginf(out[0, 8:]).all()


def test_the_argmax_of_the_kept_logits_is_the_argmax_over_the_vocabulary(draft):
    """Greedy drafting takes the argmax of the kept logits and maps it to its id."""
    drafter = DraftModelDrafter(loaded(draft), VOCAB, 64, draft_vocab_size=20)
    vocab = drafter.vocab
    assert [vocab.token(i) for i in range(vocab.size)] == [i for a, b in vocab.ranges for i in range(a, b)]
    with pytest.raises(IndexError):
        vocab.token(vocab.size)
    x = torch.randn(32, draft.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(draft.dtype)
    kept = vocab(x)  # [32, size]
    kept[3, :] = 0.0  # a tie everywhere: the lowest id wins either way
    assert [drafter._argmax(row) for row in kept] == vocab.expand(kept).argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_cut_draft_proposes_only_kept_ids(target, draft, temperature):
    drafter = DraftModelDrafter(loaded(draft), VOCAB, 256, draft_vocab_size=16)
    engine = Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False),
                    max_model_len=256, drafter=drafter)
    proposed: list[int] = []
    propose = drafter.propose

    def spy(seq, k):
        proposal = propose(seq, k)
        proposed.extend(proposal.tokens)
        if proposal.probs is not None:  # q is zero outside the kept ids
            assert (proposal.probs[:, ~kept_mask(drafter.vocab, VOCAB)] == 0).all()
        return proposal

    drafter.propose = spy
    engine.generate(PROMPT, SamplingParams(temperature=temperature, max_tokens=40, seed=3))
    keep = kept_mask(drafter.vocab, VOCAB)
    assert proposed and all(keep[t] for t in proposed)


@pytest.mark.parametrize("size", [16, 40])
def test_greedy_output_with_a_cut_draft_is_plain_decodings(target, draft, size):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    for k in (2, 5):
        drafter = DraftModelDrafter(loaded(draft), VOCAB, 256, draft_vocab_size=size)
        spec = Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=k, adaptive=False),
                      max_model_len=256, drafter=drafter).generate(PROMPT, params)
        assert spec.output_ids == plain.output_ids
        assert spec.metrics.num_accepted_tokens > 0
    # the plain output has ids past the cut, which the draft can never propose
    assert any(t >= 32 for t in plain.output_ids)


def test_greedy_output_of_a_cut_tree_draft_is_plain_decodings(target, draft):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, speculative_eagle_topk=2,
                               num_draft_tokens=5, adaptive=False, draft_vocab_size=24)
    drafter = draft_model_drafter(loaded(draft), config, DrafterContext(loaded(target), 256))
    assert drafter.vocab is not None and drafter.vocab.ranges[0][1] >= 24
    spec = Engine(loaded(target), config, max_model_len=256, drafter=drafter).generate(PROMPT, params)
    assert spec.output_ids == plain.output_ids


def test_the_config_reaches_the_chain_drafter(target, draft):
    config = SpeculativeConfig(method="draft_model", draft_vocab_size=16)
    drafter = draft_model_drafter(loaded(draft), config, DrafterContext(loaded(target), 64))
    assert drafter.vocab.ranges[0][0] == 0 and drafter.vocab.size < VOCAB


def test_a_size_at_or_past_the_vocabulary_keeps_the_whole_head(draft):
    assert DraftModelDrafter(loaded(draft), VOCAB, 64, draft_vocab_size=VOCAB).vocab is None
    assert DraftModelDrafter(loaded(draft), VOCAB, 64, draft_vocab_size=10**6).vocab is None
    assert DraftModelDrafter(loaded(draft), VOCAB, 64).vocab is None  # "tiny" is no bundled model


def test_bundled_qwen_drafts_score_the_base_vocabulary_by_default():
    assert bundled_draft_vocab_size("qwen2.5-coder-0.5b-instruct") == 100_256
    assert bundled_draft_vocab_size("smollm2-135m-instruct") is None
    assert bundled_draft_vocab_size("some/other-model") is None


def test_a_head_that_cannot_be_cut_is_a_clear_error():
    model = quantize_(copy.deepcopy(tiny_model(vocab=VOCAB, seed=2)), "int8", native=False)  # an Int8Linear head
    with pytest.raises(ValueError, match="draft_vocab_size: the draft's LM head \\(Int8Linear\\) cannot be cut"):
        DraftModelDrafter(loaded(model), VOCAB, 64, draft_vocab_size=16)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "many", True])
def test_a_bad_draft_vocab_size_is_refused(bad):
    with pytest.raises(ValueError, match="draft_vocab_size must be a positive integer or null"):
        SpeculativeConfig(method="draft_model", draft_vocab_size=bad)
    assert SpeculativeConfig.from_json('{"method": "draft_model", "draft_vocab_size": 4096}').draft_vocab_size == 4096


# ---- draft_head_quantization: the kept head requantized to Q4_1 ------------------------------


@pytest.fixture(scope="module")
def native_draft(target):
    return close_draft(target, native=True)


@pytest.mark.parametrize("size", [24, VOCAB])
def test_an_int4_head_multiplies_by_ggufs_q4_1_of_the_kept_rows(native_draft, size):
    from gguf import GGMLQuantizationType, quants

    vocab = DraftVocabulary(native_draft, size, special_ids=[60], target_vocab=VOCAB, quantization="int4")
    keep = kept_mask(vocab, VOCAB)
    full = native_draft.lm_head.dequantize()  # [V, H], the Q8_0 head as the kernels read it
    q4_1 = GGMLQuantizationType(kernels.FORMATS["Q4_1"])
    expected = torch.from_numpy(quants.dequantize(quants.quantize(full[keep].numpy(), q4_1), q4_1))
    assert [kernels.format_name(p.fmt) for p in vocab.head.parts] == ["Q4_1"]
    assert torch.equal(vocab.head.dequantize(), expected)
    assert not torch.equal(expected, full[keep])  # a different weight, so a different q
    x = torch.randn(5, native_draft.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = vocab(x)
    assert logits.shape == (5, vocab.size)
    assert torch.allclose(logits, x @ expected.T, rtol=0.05, atol=0.05)  # int8 activations, per-block scales


@pytest.mark.parametrize("size", [16, None])
def test_greedy_output_with_an_int4_head_is_plain_decodings(target, native_draft, size):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    for k in (2, 5):
        drafter = DraftModelDrafter(loaded(native_draft), VOCAB, 256, draft_vocab_size=size,
                                    draft_head_quantization="int4")
        assert kernels.format_name(drafter.vocab.head.parts[0].fmt) == "Q4_1"
        spec = Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=k, adaptive=False),
                      max_model_len=256, drafter=drafter).generate(PROMPT, params)
        assert spec.output_ids == plain.output_ids
        assert spec.metrics.num_accepted_tokens > 0


def test_greedy_output_of_a_tree_draft_with_an_int4_head_is_plain_decodings(target, native_draft):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, speculative_eagle_topk=2,
                               num_draft_tokens=5, adaptive=False, draft_head_quantization="int4")
    drafter = draft_model_drafter(loaded(native_draft), config, DrafterContext(loaded(target), 256))
    assert drafter.vocab.size == VOCAB and kernels.format_name(drafter.vocab.head.parts[0].fmt) == "Q4_1"
    spec = Engine(loaded(target), config, max_model_len=256, drafter=drafter).generate(PROMPT, params)
    assert spec.output_ids == plain.output_ids


def test_bundled_qwen_drafts_requantize_their_head_by_default(target, native_draft):
    assert bundled_draft_head_quantization("qwen2.5-coder-0.5b-instruct") == "int4"
    assert bundled_draft_head_quantization("smollm2-135m-instruct") is None
    assert bundled_draft_head_quantization("some/other-model") is None
    named = loaded(native_draft, name="qwen2.5-coder-0.5b-instruct")  # the bundled defaults by name
    drafter = DraftModelDrafter(named, VOCAB, 64)
    assert kernels.format_name(drafter.vocab.head.parts[0].fmt) == "Q4_1"
    assert DraftModelDrafter(named, VOCAB, 64, draft_head_quantization="none").vocab is None  # VOCAB < 100,256
    assert DraftModelDrafter(loaded(native_draft), VOCAB, 64).vocab is None  # not bundled: the head as loaded
    # a dense draft under a bundled name keeps its head as it is, rather than failing
    dense = loaded(tiny_model(vocab=VOCAB, seed=2), name="qwen2.5-coder-0.5b-instruct")
    assert DraftModelDrafter(dense, VOCAB, 64).vocab is None


def test_an_int4_head_off_the_native_kernels_is_a_clear_error():
    with pytest.raises(ValueError, match="draft_head_quantization 'int4' requantizes a head on the native kernels, "
                                         "and this draft's LM head is Linear"):
        DraftModelDrafter(loaded(tiny_model(vocab=VOCAB, seed=2)), VOCAB, 64, draft_head_quantization="int4")


@pytest.mark.parametrize("bad", ["int8", "q4_1", 4, True])
def test_a_bad_draft_head_quantization_is_refused(bad):
    with pytest.raises(ValueError, match="draft_head_quantization must be one of none, int4 or null"):
        SpeculativeConfig(method="draft_model", draft_head_quantization=bad)
    config = SpeculativeConfig.from_json('{"method": "draft_model", "draft_head_quantization": "none"}')
    assert config.draft_head_quantization == "none"
