"""Medusa heads: the FasterDecoding checkpoint layout, proposals, training, and losslessness
(greedy identity and the sampled distribution, as chain and tree)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import verispec.speculative.verify as verify_module
from verispec import kernels
from distribution import PROMPT, SETTINGS, VOCAB, exact_joint, goodness_of_fit, passes, sample_counts
from tiny import bigram, loaded, sampled_rows, tiny_model, torch_threads
from verispec.config import SamplingParams, SpeculativeConfig, TrainSettings
from verispec.engine.engine import Engine
from verispec.models.quant import quantize_
from verispec.speculative.base import DrafterContext
from verispec.speculative.registry import build_drafter
from verispec.speculative.medusa import MedusaDrafter, MedusaHeads, load_medusa, save_medusa
from verispec.speculative.tree import Tree
from verispec.train.data import choose_draft_vocab, target_features
from verispec.train.drafter import train_medusa
from verispec.train.losses import medusa_loss


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):  # tiny models run fastest on one thread
        yield


def trained_heads(decoder, num_heads: int = 3, steps: int = 150, seed: int = 0,
                  draft_vocab_size: int | None = None) -> MedusaHeads:
    """Heads trained briefly on the target's own samples (Medusa-1 self-distillation); with
    ``draft_vocab_size``, on the samples' most frequent tokens only."""
    torch.manual_seed(seed)
    cfg = decoder.config
    rows = sampled_rows(decoder, 64, 24, seed)
    d2t = choose_draft_vocab(rows.tolist(), cfg.vocab_size, draft_vocab_size or cfg.vocab_size)
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, 1, draft_vocab_size=len(d2t))
    heads.d2t.copy_(d2t)
    heads.init_from_target(decoder.lm_head.weight.float()[heads.target_ids(torch.arange(len(d2t)))])
    hidden = target_features(decoder, rows)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        medusa_loss(heads, hidden, rows).backward()
        opt.step()
    return heads.requires_grad_(False)


# ---- checkpoints -----------------------------------------------------------------------------


def test_the_faster_decoding_layout_round_trips(tmp_path):
    heads = MedusaHeads(64, 48, num_heads=3, num_layers=2)
    torch.nn.init.normal_(heads.blocks[1][0].weight)
    save_medusa(heads, tmp_path, base_model="tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
    keys = set(load_file(str(tmp_path / "medusa_lm_head.safetensors")))
    assert keys == {f"{i}.{j}.linear.{w}" for i in range(3) for j in range(2) for w in ("weight", "bias")} | {
        f"{i}.2.weight" for i in range(3)}
    again = load_medusa(tmp_path, 64, 48)
    h = torch.randn(5, 64)
    assert torch.equal(again(h), heads(h))


def test_a_torch_checkpoint_written_like_faster_decoding_loads(tmp_path):
    """``medusa_lm_head.pt`` is the state dict of FasterDecoding's ModuleList of
    ``Sequential(ResBlock * L, Linear(H, V, bias=False))``, rebuilt here module for module."""
    class ResBlock(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.linear = torch.nn.Linear(hidden, hidden)
            self.act = torch.nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    torch.manual_seed(0)
    reference = torch.nn.ModuleList(torch.nn.Sequential(ResBlock(64), torch.nn.Linear(64, 48, bias=False))
                                    for _ in range(2))
    torch.save(reference.state_dict(), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                      "base_model_name_or_path": "x"}))
    heads = load_medusa(tmp_path, 64, 48)
    h = torch.randn(3, 64)
    with torch.no_grad():
        want = torch.stack([reference[i](h) for i in range(2)])
    torch.testing.assert_close(heads(h), want, rtol=0, atol=1e-6)


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_medusa(tmp_path, 64, 48)
    save_medusa(MedusaHeads(64, 48, 2), tmp_path)
    with pytest.raises(ValueError, match="shape"):
        load_medusa(tmp_path, 64, 50)  # another vocabulary
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="missing"):
        load_medusa(tmp_path, 64, 48)
    target = loaded(tiny_model(seed=1))
    with pytest.raises(ValueError, match="needs \"model\""):
        build_drafter(SpeculativeConfig(method="medusa"), DrafterContext(target, 64))


def test_heads_without_lm_heads_share_the_targets(tmp_path):
    decoder = tiny_model(seed=1, dtype=torch.float32)
    heads = MedusaHeads(64, 48, 2, own_lm_heads=False)
    heads.init_from_target(decoder.lm_head.weight)  # identity ResBlocks
    save_medusa(heads, tmp_path)
    drafter = build_drafter(SpeculativeConfig(method="medusa", model=str(tmp_path), num_speculative_tokens=2),
                            DrafterContext(loaded(decoder), 64))
    h = torch.randn(1, 64)
    # identity ResBlocks and the target's head: every head gives the target's logits
    torch.testing.assert_close(drafter.heads(h, drafter.target_head)[1], decoder.logits(h))


def reduced_heads(own_lm_heads: bool = True) -> MedusaHeads:
    """Heads over 48 target tokens that score 32 of them (every third token left out)."""
    ids = torch.tensor([i for i in range(48) if i % 3][:32])
    heads = MedusaHeads(64, 48, 2, own_lm_heads=own_lm_heads, draft_vocab_size=32)
    heads.d2t.copy_(ids - torch.arange(32))
    for block in heads.blocks:
        torch.nn.init.normal_(block[0].weight, std=0.05)
    return heads


def test_a_reduced_draft_vocabulary_round_trips_and_proposes_target_ids(tmp_path):
    heads = reduced_heads()
    save_medusa(heads, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 32
    again = load_medusa(tmp_path, 64, 48)
    h = torch.randn(3, 64)
    assert again.draft_vocab_size == 32 and torch.equal(again(h), heads(h))  # [2, 3, 32]
    full = again.target_logits(again(h))  # [2, 3, 48]
    left_out = torch.arange(0, 48, 3)
    assert full.shape == (2, 3, 48) and bool(torch.isinf(full[..., left_out]).all())
    assert torch.equal(full[..., again.target_ids(torch.arange(32))], again(h))
    drafter = MedusaDrafter(again)
    seq = SimpleNamespace(slot=0, params=SamplingParams(temperature=0.0), target_hidden=h[:1])
    drafter.start(seq)
    tokens = drafter.propose(seq, 2).tokens
    assert tokens == full[:, 0].argmax(-1).tolist() and all(t % 3 for t in tokens)
    # a target token outside the draft vocabulary is left out of the loss, not scored as class 0
    assert again.draft_labels(torch.tensor([1, 3, 47])).tolist() == [0, -100, 31]


def test_a_reduced_vocabulary_checkpoint_must_map_into_distinct_target_ids(tmp_path):
    heads = reduced_heads()
    heads.d2t[1] = 0  # draft ids 0 and 1 both map to target id 1
    save_medusa(heads, tmp_path)
    with pytest.raises(ValueError, match="distinct target ids"):
        load_medusa(tmp_path, 64, 48)
    state = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    del state["d2t"]
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="needs a d2t"):
        load_medusa(tmp_path, 64, 48)


def test_shared_heads_with_a_reduced_vocabulary_read_the_targets_rows_on_the_kernels(tmp_path):
    decoder = tiny_model(seed=1, dtype=torch.float32)
    heads = reduced_heads(own_lm_heads=False)
    save_medusa(heads, tmp_path)
    rows = decoder.lm_head.weight[heads.target_ids(torch.arange(32))]  # [32, 64]
    h = torch.randn(1, 64)
    want = heads(h, lambda x: x @ rows.T)  # float32 ResBlocks and rows: [2, 1, 32]
    for quantization in ("none", "auto"):
        drafter = build_drafter(SpeculativeConfig(method="medusa", model=str(tmp_path), num_speculative_tokens=2,
                                                  quantization=quantization), DrafterContext(loaded(decoder), 64))
        got = drafter.heads(h, drafter.target_head)
        if quantization == "none":
            torch.testing.assert_close(got, want)
        else:  # Q8_0 weights and activations on the native kernels: close, not equal
            assert kernels.available()
            assert type(drafter.heads.blocks[0][0]).__name__ == "NativeLinear"
            assert ((got - want).norm() / want.norm()).item() < 0.02
    with pytest.raises(ValueError, match="float32 .* or Q8_0"):
        build_drafter(SpeculativeConfig(method="medusa", model=str(tmp_path), quantization="int4"),
                      DrafterContext(loaded(decoder), 64))


# ---- training --------------------------------------------------------------------------------


def test_training_lowers_the_loss_on_held_out_samples():
    decoder = tiny_model(seed=1, dtype=torch.float32)
    held_out = sampled_rows(decoder, 32, 24, seed=99)
    hidden = target_features(decoder, held_out)
    untrained = MedusaHeads(64, 48, 3)
    untrained.init_from_target(decoder.lm_head.weight.float())
    trained = trained_heads(decoder)
    with torch.no_grad():
        before = medusa_loss(untrained, hidden, held_out).item()
        after = medusa_loss(trained, hidden, held_out).item()
    assert after < 0.8 * before, (before, after)


# ---- losslessness ----------------------------------------------------------------------------

PROMPT_G = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]


@pytest.fixture(scope="module")
def greedy_models():
    decoder = tiny_model(seed=1)  # bf16, as the engine tests' target
    return decoder, trained_heads(decoder)


def generate(decoder, params, drafter=None, k=0, prompt=PROMPT_G):
    spec = SpeculativeConfig(method="medusa", num_speculative_tokens=k, adaptive=False) if k else None
    engine = Engine(loaded(decoder), spec, max_model_len=256, drafter=drafter)
    return engine.generate(prompt, params)


TREES = {
    "chain": {},
    "static tree": {"tree": Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])},
    "dynamic tree": {"topk": 2, "budget": 6},
}


@pytest.mark.parametrize("shape", TREES)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_to_plain(greedy_models, shape, k):
    decoder, heads = greedy_models
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = generate(decoder, params)
    spec = generate(decoder, params, MedusaDrafter(heads, **TREES[shape]), k)
    assert spec.output_ids == plain.output_ids
    m = spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # not vacuous: some kept, some rejected


@pytest.mark.parametrize("shape", ["chain", "dynamic tree"])
def test_greedy_output_is_identical_to_plain_with_a_reduced_vocabulary(tmp_path, shape):
    """Heads that score 32 of the 48 tokens, shared LM-head rows, Q8_0 on the native kernels
    (the drafter as ``--speculative-config`` builds it)."""
    decoder = tiny_model(seed=1)
    heads = trained_heads(decoder, draft_vocab_size=32)
    heads.lm_heads = None  # share the target's rows (the trained heads' own started from them)
    save_medusa(heads, tmp_path)
    tree = {"speculative_eagle_topk": 2, "num_draft_tokens": 6} if shape == "dynamic tree" else {}
    spec = SpeculativeConfig(method="medusa", model=str(tmp_path), num_speculative_tokens=3, adaptive=False, **tree)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = generate(decoder, params)
    engine = Engine(loaded(decoder), spec, max_model_len=256)
    assert engine.drafter.heads.reduced
    out = engine.generate(PROMPT_G, params)
    assert out.output_ids == plain.output_ids
    m = out.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens


@pytest.fixture(scope="module")
def dist_models():
    decoder = tiny_model(vocab=VOCAB, seed=11, layers=1, dtype=torch.float32)
    with torch.no_grad():
        decoder.lm_head.weight.mul_(0.25)  # the harness's flat target
    return decoder, trained_heads(decoder, num_heads=2, steps=60)


@pytest.fixture(scope="module")
def dist_models_reduced(dist_models):
    """The same target, heads that score 12 of its 16 tokens: q = 0 for the other 4, which the
    target samples too (only the residual can give them)."""
    decoder, _ = dist_models
    return decoder, trained_heads(decoder, num_heads=2, steps=60, draft_vocab_size=12)


def sampled(decoder, heads, shape, params):
    engine = Engine(loaded(decoder), SpeculativeConfig(method="medusa", num_speculative_tokens=2, adaptive=False),
                    max_model_len=64, drafter=MedusaDrafter(heads, **TREES[shape]))
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    return counts, engine.metrics


# The dynamic tree verifies like the static one (deterministic top-k children): `make test-long`.
@pytest.mark.parametrize("shape", ["chain", "static tree", pytest.param("dynamic tree", marks=pytest.mark.long)])
def test_sampling_keeps_the_targets_distribution(dist_models, shape):
    decoder, heads = dist_models
    params = SETTINGS["temperature=1.0"]
    counts, m = sampled(decoder, heads, shape, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(decoder, params))
    print(f"{shape}: acceptance {m.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, TV={tv:.4f}")
    # Not vacuous: drafts are accepted often enough, and rejected often enough to exercise the
    # residual (a tree's rate is per node, most of which cannot all be kept).
    assert 0.05 * m.num_draft_tokens < m.num_accepted_tokens < 0.9 * m.num_draft_tokens
    assert passes(pvalue, tv)


def test_sampling_keeps_the_targets_distribution_with_a_reduced_vocabulary(dist_models_reduced):
    decoder, heads = dist_models_reduced
    assert heads.reduced and heads.draft_vocab_size == 12
    params = SETTINGS["temperature=1.0"]
    counts, m = sampled(decoder, heads, "chain", params)
    joint = exact_joint(decoder, params)
    pvalue, tv = goodness_of_fit(counts, joint)
    print(f"reduced vocabulary: acceptance {m.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, TV={tv:.4f}")
    assert 0.05 * m.num_draft_tokens < m.num_accepted_tokens < 0.9 * m.num_draft_tokens
    assert passes(pvalue, tv)


def test_a_drafter_blind_to_its_vocabulary_gap_fails_the_same_test(dist_models_reduced, monkeypatch):
    """Negative control for the reduced vocabulary: recovering from the residual over the draft
    vocabulary only (never a token the heads cannot propose) is biased."""
    decoder, heads = dist_models_reduced
    inside = torch.zeros(heads.vocab_size, dtype=torch.bool)
    inside[heads.target_ids(torch.arange(heads.draft_vocab_size))] = True
    right = verify_module._recovery_distribution

    def blind(p, q):
        w = right(p, q)
        r = w * inside.to(w.dtype)
        return torch.where(r.sum(-1, keepdim=True) > 0, r, w)

    monkeypatch.setattr(verify_module, "_recovery_distribution", blind)
    params = SETTINGS["temperature=1.0"]
    counts, _ = sampled(decoder, heads, "chain", params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(decoder, params))
    print(f"negative control (reduced vocabulary): chi2 p={pvalue:.2e}, TV={tv:.4f}")
    assert not passes(pvalue, tv)


def test_a_wrong_recovery_rule_fails_the_same_test(dist_models, monkeypatch):
    """Negative control: recovering from p instead of normalize(max(p - q, 0)) is biased."""
    decoder, heads = dist_models
    monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    counts, _ = sampled(decoder, heads, "chain", params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(decoder, params))
    print(f"negative control: chi2 p={pvalue:.2e}, TV={tv:.4f}")
    assert not passes(pvalue, tv)


# ---- train-drafter -----------------------------------------------------------------------------


def tiny_training(tmp_path, steps: int, resume: bool = False, rows=None, draft_vocab_size: int = 32768):
    decoder = bigram(tiny_model(seed=1, dtype=torch.float32))
    rows = rows if rows is not None else sampled_rows(decoder, 40, 24, seed=3, greedy=True).tolist()
    settings = TrainSettings(num_heads=3, steps=steps, batch_size=8, lr=1e-2, seq_len=24, eval_every=20,
                             save_every=20, held_out=0.25, draft_vocab_size=draft_vocab_size)
    return train_medusa(loaded(decoder), rows, tmp_path, settings, resume=resume, log=lambda _: None,
                        progress=False), decoder


def test_a_tiny_training_run_beats_the_untrained_heads_on_held_out_rows(tmp_path):
    reports, decoder = tiny_training(tmp_path, 60)
    first, last = reports[0], reports[-1]
    assert first.step == 0 and last.step == 60
    print(first.line(), last.line(), sep="\n")
    assert last.mean_acceptance_length > first.mean_acceptance_length + 1.0
    assert all(after > before for before, after in zip(first.head_accuracy, last.head_accuracy))
    heads = load_medusa(tmp_path, 64, 48)  # the FasterDecoding layout, loadable as a drafter
    assert heads.num_heads == 3 and (tmp_path / "train_report.json").is_file()


def test_a_tiny_training_run_with_a_reduced_vocabulary_learns_and_writes_its_d2t(tmp_path):
    rows = sampled_rows(bigram(tiny_model(seed=1, dtype=torch.float32)), 40, 24, seed=3, greedy=True).tolist()
    used = len({t for r in rows for t in r})
    reports, _ = tiny_training(tmp_path, 60, rows=rows, draft_vocab_size=used - 4)  # some tokens left out
    first, last = reports[0], reports[-1]
    print(first.line(), last.line(), sep="\n")
    assert last.mean_acceptance_length > first.mean_acceptance_length + 0.5
    heads = load_medusa(tmp_path, 64, 48)
    assert heads.draft_vocab_size == used - 4 and heads.lm_heads is None
    counts = torch.bincount(torch.tensor(rows).flatten(), minlength=48)
    kept = heads.target_ids(torch.arange(heads.draft_vocab_size))
    assert counts[kept].min() >= counts[[t for t in range(48) if t not in set(kept.tolist())]].max()


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    straight, _ = tiny_training(tmp_path / "a", 40)
    tiny_training(tmp_path / "b", 20)
    resumed, _ = tiny_training(tmp_path / "b", 40, resume=True)
    assert resumed[-1] == straight[-1]
    a, b = load_medusa(tmp_path / "a", 64, 48), load_medusa(tmp_path / "b", 64, 48)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_round_computes_only_the_heads_it_drafts_with():
    heads = MedusaHeads(64, 48, num_heads=4)
    h = torch.randn(2, 64)
    assert torch.equal(heads(h, num_heads=2), heads(h)[:2])
    calls = []
    for i, head in enumerate(heads.lm_heads):
        head.register_forward_hook(lambda *_, i=i: calls.append(i))
    drafter = MedusaDrafter(heads)
    seq = SimpleNamespace(slot=0, params=SamplingParams(temperature=0.0), target_hidden=h)
    drafter.start(seq)
    assert len(drafter.propose(seq, 2)) == 2 and calls == [0, 1]


def test_prefix_caching_stays_on_and_a_cached_prefix_drafts_as_a_whole_prompt_does():
    """Medusa reads only the last prompt position's state, so prefix caching stays on, and a
    request that reuses a kept prefix gets that state bit for bit: the same drafts, round by
    round, and the same output as an engine that prefilled the whole prompt."""
    decoder = tiny_model(seed=1, dtype=torch.float32)  # float32: rows do not depend on the pass
    heads = trained_heads(decoder)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    native = quantize_(tiny_model(seed=1, dtype=torch.float32), "int8", dense_prefill=False, native=True)
    spec = SpeculativeConfig(method="medusa", num_speculative_tokens=3)
    assert Engine(loaded(native), spec, max_model_len=64, drafter=MedusaDrafter(heads), prefix_caching=None).prefix_caching

    def engine(drafts: list | None = None):
        if drafts is None:
            return Engine(loaded(decoder), None, max_model_len=256, prefix_caching=True)
        drafter = MedusaDrafter(heads)
        propose = drafter.propose

        def recorded(seq, k):
            proposal = propose(seq, k)
            drafts.append(list(proposal.tokens))
            return proposal

        drafter.propose = recorded
        spec = SpeculativeConfig(method="medusa", num_speculative_tokens=3, adaptive=False)
        return Engine(loaded(decoder), spec, max_model_len=256, drafter=drafter, prefix_caching=True)

    cached_drafts, whole_drafts = [], []
    eng = engine(cached_drafts)
    assert eng.prefix_caching
    first = eng.generate(PROMPT_G, params)
    prompt = first.prompt_ids + first.output_ids + [5, 9, 13, 2]
    cached_drafts.clear()
    second = eng.generate(prompt, params)
    assert second.metrics.cached_prompt_tokens > len(PROMPT_G)
    whole = engine(whole_drafts).generate(prompt, params)
    assert whole.metrics.cached_prompt_tokens == 0
    assert second.output_ids == whole.output_ids == engine().generate(prompt, params).output_ids
    assert len(cached_drafts) > 10 and cached_drafts == whole_drafts
