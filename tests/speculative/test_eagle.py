"""EAGLE-3 heads: the public checkpoint layouts, the drafter against the training-time test,
training, and losslessness (greedy identity and the sampled distribution, chain and tree)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

import verispec.speculative.verify as verify_module
from distribution import PROMPT, SETTINGS, VOCAB, exact_joint, goodness_of_fit, passes, sample_counts
from tiny import bigram, loaded, sampled_rows, tiny_model, torch_threads
from verispec.config import SamplingParams, SpeculativeConfig, TrainSettings
from verispec import kernels
from verispec.engine.engine import Engine
from verispec.models.native import NativeLinear
from verispec.models.quant import quantize_
from verispec.speculative.base import DrafterContext
from verispec.speculative.registry import build_drafter
from verispec.speculative.eagle import EagleDrafter
from verispec.speculative.eagle_head import Eagle3Head, EagleConfig, default_aux_layers, load_eagle, save_eagle
from verispec.train.data import choose_draft_vocab, target_eagle_features
from verispec.train.drafter import train_eagle
from verispec.train.losses import eagle_loss, eagle_unrolled


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):  # tiny models run fastest on one thread
        yield


def head_config(target, draft_vocab: int | None = None, **kw) -> EagleConfig:
    c = target.config
    return EagleConfig(hidden_size=c.hidden_size, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=c.vocab_size, draft_vocab_size=draft_vocab or c.vocab_size,
                       target_hidden_size=c.hidden_size, aux_layers=default_aux_layers(c.num_layers), **kw)


def random_head(config: EagleConfig, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.2 * torch.randn(p.shape))
    return head


def trained_head(decoder, draft_vocab: int | None = None, steps: int = 150, seed: int = 0, greedy: bool = False,
                 never_draft: int | None = None) -> Eagle3Head:
    """A head trained briefly on the target's own samples (or greedy answers) with the
    training-time test; ``never_draft`` is left out of its draft vocabulary."""
    rows = sampled_rows(decoder, 64, 24, seed, greedy=greedy)
    config = head_config(decoder, draft_vocab)
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    counted = rows.tolist()
    if never_draft is not None:  # one extra row holding every other token once: the left-out one ranks last
        counted = [[t for t in row if t != never_draft] for row in counted]
        counted.append([t for t in range(config.vocab_size) if t != never_draft])
    with torch.no_grad():
        head.d2t.copy_(choose_draft_vocab(counted, config.vocab_size, config.draft_vocab_size))
    feats = target_eagle_features(decoder, rows, config.aux_layers)
    embeds = decoder.embed(rows).float()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        eagle_loss(head, feats, rows, embeds, steps=3).backward()
        opt.step()
    return head.requires_grad_(False)


PROMPT_G = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]


# ---- the drafter computes what training unrolls ------------------------------------------------


def test_the_drafters_cache_reproduces_the_training_time_test():
    """Unrolled step j at base t (training) and the drafter's j-th draft after committing t
    (its cache of target-feature entries, then its own chain) compute the same logits."""
    decoder = tiny_model(seed=1, layers=4, dtype=torch.float32)
    head = random_head(head_config(decoder, draft_vocab=40))
    head.d2t.copy_(choose_draft_vocab([list(range(48))], 48, 40))
    rows = torch.randint(48, (1, 20), generator=torch.Generator().manual_seed(0))
    feats = target_eagle_features(decoder, rows, head.config.aux_layers)
    with torch.no_grad():
        unrolled = eagle_unrolled(head, feats, rows, decoder.embed(rows).float(), 3)
    drafter = EagleDrafter(head, decoder.embed, 64)
    for base in (5, 11):  # commit rows 0..base, as after a prefill of base + 1 tokens
        seq = SimpleNamespace(slot=0, params=SamplingParams(temperature=0.0), target_hidden=feats[0, : base + 1],
                              token_ids=rows[0, : base + 2].tolist())
        drafter.start(seq)
        drafter.propose(seq, 1)
        logits, out = drafter._last[0]
        torch.testing.assert_close(logits, unrolled[0][0, base], rtol=0, atol=1e-5)
        with torch.inference_mode():
            for j in (1, 2):  # the drafter's chain, fed the true tokens as training does
                out = drafter._feed(0, [int(rows[0, base + j + 1])], out[None, None], [base + j])[0, 0]
                torch.testing.assert_close(head.logits(out), unrolled[j][0, base], rtol=0, atol=1e-5)


def test_rounds_without_drafts_queue_their_positions():
    """The controller's plain rounds report back without a proposal in between: the head must
    still read every committed position, in order."""
    decoder = tiny_model(seed=1, layers=4, dtype=torch.float32)
    head = random_head(head_config(decoder))
    rows = torch.randint(48, (1, 20), generator=torch.Generator().manual_seed(1))
    feats = target_eagle_features(decoder, rows, head.config.aux_layers)
    with torch.no_grad():
        step0 = eagle_unrolled(head, feats, rows, decoder.embed(rows).float(), 1)[0]
    drafter = EagleDrafter(head, decoder.embed, 64)
    seq = SimpleNamespace(slot=0, params=SamplingParams(temperature=0.0), target_hidden=feats[0, :8],
                          token_ids=rows[0, :9].tolist())
    drafter.start(seq)
    drafter.propose(seq, 2)
    for end in (10, 11, 14):  # three rounds' commits (2, 1 and 3 tokens), one proposal after them
        seq.target_hidden, seq.token_ids = feats[0, len(seq.token_ids) - 1 : end], rows[0, : end + 1].tolist()
        drafter.feedback(seq, None)
    drafter.propose(seq, 1)
    assert drafter.cache.length(0) == 14
    torch.testing.assert_close(drafter._last[0][0], step0[0, 13], rtol=0, atol=1e-5)


# ---- checkpoints -----------------------------------------------------------------------------------


def layout_state(head: Eagle3Head, prefix: str, embed: bool) -> dict[str, torch.Tensor]:
    """The head's weights under the public names, written out here independently of the loader."""
    layer = {"input_layernorm.weight": head.input_norm.weight, "hidden_norm.weight": head.hidden_norm.weight,
             "self_attn.q_proj.weight": head.q_proj.weight, "self_attn.k_proj.weight": head.k_proj.weight,
             "self_attn.v_proj.weight": head.v_proj.weight, "self_attn.o_proj.weight": head.o_proj.weight,
             "post_attention_layernorm.weight": head.post_attn_norm.weight,
             "mlp.gate_proj.weight": head.gate_proj.weight, "mlp.up_proj.weight": head.up_proj.weight,
             "mlp.down_proj.weight": head.down_proj.weight}
    state = {prefix + k: v.detach().clone() for k, v in layer.items()}
    state.update({"fc.weight": head.fc.weight.detach().clone(), "norm.weight": head.norm.weight.detach().clone(),
                  "lm_head.weight": head.lm_head.weight.detach().clone(), "d2t": head.d2t.clone()})
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.d2t + torch.arange(len(head.d2t))] = True
    state["t2d"] = t2d
    if embed:
        state["embed_tokens.weight"] = torch.randn(head.config.vocab_size, head.config.hidden_size)
    return state


def llama_config(c: EagleConfig) -> dict:
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "num_hidden_layers": 1,
            "hidden_act": "silu", "model_type": "llama"}


def write_specforge(directory, head: Eagle3Head, layer_ids=None, embed: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = {**llama_config(head.config), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": head.config.draft_vocab_size}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(layout_state(head, "midlayer.", embed), str(directory / "model.safetensors"))


def write_speculators(directory, head: Eagle3Head, layer_ids=None, embed: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": llama_config(head.config),
              "draft_vocab_size": head.config.draft_vocab_size, "target_hidden_size": head.config.target_hidden_size,
              "norm_before_residual": True,
              "speculators_config": {"algorithm": "eagle3",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    (directory / "config.json").write_text(json.dumps(config))
    save_file(layout_state(head, "layers.0.", embed), str(directory / "model.safetensors"))


def reference_step(state: dict, prefix: str, cfg: dict, norm_before: bool, embeds, feats) -> torch.Tensor:
    """The draft-vocabulary logits of one causal pass, computed from a checkpoint's own tensors
    the way vLLM's Eagle3 Llama layer does (written here, not shared with the code under test)."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    w = {k.removeprefix(prefix): v.float() for k, v in state.items()}
    t, nh, nkv, d = embeds.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = feats @ w["fc.weight"].T
    residual = rms(g, w["hidden_norm.weight"]) if norm_before else g
    x = torch.cat([rms(embeds, w["input_layernorm.weight"]), rms(g, w["hidden_norm.weight"])], -1)
    q = (x @ w["self_attn.q_proj.weight"].T).view(t, nh, d).transpose(0, 1)
    k = (x @ w["self_attn.k_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
    v = (x @ w["self_attn.v_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(t).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(z):
        return z * cos + torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1) * sin

    attn = F.scaled_dot_product_attention(rope(q), rope(k).repeat_interleave(nh // nkv, 0),
                                          v.repeat_interleave(nh // nkv, 0), is_causal=True)
    h = residual + attn.transpose(0, 1).reshape(t, -1) @ w["self_attn.o_proj.weight"].T
    y = rms(h, w["post_attention_layernorm.weight"])
    h = h + (F.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_public_layouts_load_and_compute_as_written(tmp_path, layout):
    decoder = tiny_model(seed=1, layers=6, dtype=torch.float32)
    source = random_head(head_config(decoder, draft_vocab=40))
    source.d2t.copy_(choose_draft_vocab([list(range(8, 48))], 48, 40))
    write = write_specforge if layout == "specforge" else write_speculators
    write(tmp_path, source, layer_ids=[1, 3, 4])
    head = load_eagle(tmp_path, decoder.config)
    # SpecForge names the layer whose output is read (index id + 1), speculators its input (index id)
    assert head.config.aux_layers == ((2, 4, 5) if layout == "specforge" else (1, 3, 4))
    assert head.config.norm_before_residual == (layout == "speculators")
    assert (head.embed is not None) == (layout == "speculators")
    assert head.target_ids(torch.arange(40)).tolist() == list(range(8, 48))
    state = load_file(str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = raw.get("transformer_layer_config", raw)
    prefix = "midlayer." if layout == "specforge" else "layers.0."
    embeds, feats = torch.randn(7, 64), torch.randn(7, 3 * 64)
    want = reference_step(state, prefix, cfg, layout == "speculators", embeds, feats)
    with torch.no_grad():
        q, k, v, residual = head.qkv(embeds[None], head.fc(feats)[None], torch.arange(7)[None])
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        got = head.logits(head.finish(attn, residual))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_default_layers_and_a_round_trip_through_save(tmp_path):
    decoder = tiny_model(seed=1, layers=6, dtype=torch.float32)
    write_specforge(tmp_path / "a", random_head(head_config(decoder)))
    assert load_eagle(tmp_path / "a", decoder.config).config.aux_layers == (2, 3, 3) == default_aux_layers(6)
    assert default_aux_layers(28) == (2, 14, 25)
    head = random_head(head_config(decoder, draft_vocab=30))
    head.d2t.copy_(choose_draft_vocab([[5, 5, 7]], 48, 30))
    save_eagle(head, tmp_path / "b", verifier="tiny", speculative_tokens=3)
    again = load_eagle(tmp_path / "b", decoder.config)
    assert again.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), head.state_dict().values()))


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path):
    decoder = tiny_model(seed=1, layers=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle(tmp_path, decoder.config)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither a SpecForge"):
        load_eagle(tmp_path, decoder.config)
    head = random_head(head_config(decoder, draft_vocab=40))
    write_specforge(tmp_path, head)
    other = tiny_model(vocab=50, seed=1, layers=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        load_eagle(tmp_path, other.config)
    with pytest.raises(ValueError, match="d2t does not map"):  # all-zero offsets are fine; duplicates are not
        head.d2t[1] = -1
        write_specforge(tmp_path, head)
        load_eagle(tmp_path, decoder.config)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="2 layers"):
        load_eagle(tmp_path, decoder.config)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match="shape"):
        load_eagle(tmp_path, decoder.config)
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}))
    with pytest.raises(ValueError, match="outside the target"):
        load_eagle(tmp_path, decoder.config)


def test_the_method_without_a_head_says_how_to_train_one():
    target = loaded(tiny_model(seed=1), name="tiny-target")
    for method in ("eagle", "eagle3"):
        with pytest.raises(ValueError, match="train-drafter --target tiny-target --method eagle"):
            build_drafter(SpeculativeConfig(method=method), DrafterContext(target, 64))


def test_static_trees_are_refused(tmp_path):
    decoder = tiny_model(seed=1, dtype=torch.float32)
    save_eagle(random_head(head_config(decoder)), tmp_path)
    spec = SpeculativeConfig(method="eagle3", model=str(tmp_path), speculative_token_tree=((0,), (1,)))
    with pytest.raises(ValueError, match="dynamic"):
        build_drafter(spec, DrafterContext(loaded(decoder), 64))
    drafter = build_drafter(SpeculativeConfig(method="eagle3", model=str(tmp_path)), DrafterContext(loaded(decoder), 64))
    assert drafter.hidden_layers == default_aux_layers(2)


def test_the_head_runs_on_the_native_kernels_where_its_shapes_fit(tmp_path):
    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    decoder = tiny_model(seed=1, dtype=torch.float32)
    head = random_head(head_config(decoder, draft_vocab=40))
    save_eagle(head, tmp_path)
    drafter = build_drafter(SpeculativeConfig(method="eagle", model=str(tmp_path)), DrafterContext(loaded(decoder), 64))
    native = {name for name in ("fc", "q_proj", "k_proj", "o_proj", "down_proj", "lm_head")
              if isinstance(getattr(drafter.head, name), NativeLinear)}
    assert native == {"fc", "q_proj", "k_proj", "o_proj", "down_proj"}  # 40 draft words: not a tile multiple
    exact = build_drafter(SpeculativeConfig(method="eagle", model=str(tmp_path), quantization="none"),
                          DrafterContext(loaded(decoder), 64))
    assert not any(isinstance(m, NativeLinear) for m in exact.head.modules())
    x, h, positions = torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.arange(5)[None]
    logits = []
    with torch.inference_mode():
        for head in (drafter.head, exact.head):  # fused q/k/v and gate/up on the kernels, and float32
            q, k, v, residual = head.qkv(x, h, positions)
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                  is_causal=True)
            logits.append(head.logits(head.finish(attn, residual)))
    assert drafter.head.qkv_fused is not None and drafter.head.gate_up_fused is not None
    assert ((logits[0] - logits[1]).norm() / logits[1].norm()).item() < 0.03  # Q8_0's rounding only
    for drafter in (drafter, exact):  # Q8_0 weights change the drafts, never the output
        params = SamplingParams(temperature=0.0, max_tokens=30)
        spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, adaptive=False)
        out = Engine(loaded(decoder), spec, max_model_len=64, drafter=drafter).generate(PROMPT_G, params)
        assert out.output_ids == generate(decoder, params).output_ids


# ---- losslessness ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_models():
    """A bf16 target (as the engine tests') made a bigram model, its attention output zeroed so
    that each next token depends on the last token only, and a head trained on its greedy
    answers, which it learns exactly. The plain output falls into a cycle; one of the cycle's
    tokens is left out of the draft vocabulary, so drafts are kept, and a draft due to be that
    token is rejected, whatever the CPU's rounding. (A head trained on a full random model's
    samples drafted so poorly that on an AVX2-only CPU not one draft was kept.)"""
    decoder = bigram(tiny_model(seed=1, layers=4))
    tail = generate(decoder, SamplingParams(temperature=0.0, max_tokens=60)).output_ids[-12:]
    assert len(set(tail)) > 1  # the cycle is more than the token left out
    return decoder, trained_head(decoder, draft_vocab=40, greedy=True, never_draft=tail[-1])


def generate(decoder, params, drafter=None, k=0, prompt=PROMPT_G):
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=k, adaptive=False) if k else None
    engine = Engine(loaded(decoder), spec, max_model_len=256, drafter=drafter)
    return engine.generate(prompt, params)


SHAPES = {"chain": {}, "dynamic tree": {"topk": 2, "budget": 6}}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_to_plain(greedy_models, shape, k):
    decoder, head = greedy_models
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = generate(decoder, params)
    spec = generate(decoder, params, EagleDrafter(head, decoder.embed, 256, **SHAPES[shape]), k)
    assert spec.output_ids == plain.output_ids
    m = spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # not vacuous: some kept, some rejected


def test_concurrent_sequences_keep_their_own_state(greedy_models):
    decoder, head = greedy_models
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = [PROMPT_G, PROMPT_G[::-1], [1, 2, 3, 4]]
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, adaptive=False)
    engine = Engine(loaded(decoder), spec, max_model_len=128, max_num_seqs=3,
                    drafter=EagleDrafter(head, decoder.embed, 128, num_slots=3))
    together = [engine.add_request(p, params) for p in prompts]
    while engine.running:
        engine.step()
    for prompt, seq in zip(prompts, together):
        assert seq.output_ids == generate(decoder, params, prompt=prompt).output_ids


@pytest.fixture(scope="module")
def dist_models():
    decoder = tiny_model(vocab=VOCAB, seed=11, layers=1, dtype=torch.float32)
    with torch.no_grad():
        decoder.lm_head.weight.mul_(0.25)  # the harness's flat target
    return decoder, trained_head(decoder, draft_vocab=12, steps=60)  # 4 tokens never drafted


def sampled(decoder, head, shape, params):
    engine = Engine(loaded(decoder), SpeculativeConfig(method="eagle", num_speculative_tokens=2, adaptive=False),
                    max_model_len=64, drafter=EagleDrafter(head, decoder.embed, 64, **SHAPES[shape]))
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    return counts, engine.metrics


@pytest.mark.parametrize("shape", SHAPES)
def test_sampling_keeps_the_targets_distribution(dist_models, shape):
    decoder, head = dist_models
    params = SETTINGS["temperature=1.0"]
    counts, m = sampled(decoder, head, shape, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(decoder, params))
    print(f"{shape}: acceptance {m.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, TV={tv:.4f}")
    assert 0.05 * m.num_draft_tokens < m.num_accepted_tokens < 0.9 * m.num_draft_tokens
    assert passes(pvalue, tv)


def test_a_wrong_recovery_rule_fails_the_same_test(dist_models, monkeypatch):
    """Negative control: recovering from p instead of normalize(max(p - q, 0)) is biased."""
    decoder, head = dist_models
    monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    counts, _ = sampled(decoder, head, "chain", params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(decoder, params))
    print(f"negative control: chi2 p={pvalue:.2e}, TV={tv:.4f}")
    assert not passes(pvalue, tv)


# ---- train-drafter ---------------------------------------------------------------------------------


def tiny_training(tmp_path, steps: int, resume: bool = False):
    decoder = bigram(tiny_model(seed=1, layers=4, dtype=torch.float32))
    rows = sampled_rows(decoder, 40, 24, seed=3, greedy=True).tolist()
    settings = TrainSettings(steps=steps, batch_size=8, lr=1e-2, seq_len=24, eval_every=20, save_every=20,
                             held_out=0.25, ttt_steps=3, draft_vocab_size=40, intermediate_size=96,
                             warmup_steps=5, max_grad_norm=1.0)
    return train_eagle(loaded(decoder), rows, tmp_path, settings, resume=resume, log=lambda _: None,
                       progress=False), decoder


def test_a_tiny_training_run_beats_the_untrained_head_on_held_out_rows(tmp_path):
    reports, decoder = tiny_training(tmp_path, 60)
    first, last = reports[0], reports[-1]
    assert first.step == 0 and last.step == 60
    print(first.line(), last.line(), sep="\n")
    assert last.mean_acceptance_length > first.mean_acceptance_length + 1.0
    assert all(after > before for before, after in zip(first.head_accuracy, last.head_accuracy))
    head = load_eagle(tmp_path, decoder.config)  # the speculators layout, loadable as a drafter
    assert head.config.draft_vocab_size == 40 and (tmp_path / "train_report.json").is_file()


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    straight, decoder = tiny_training(tmp_path / "a", 40)
    tiny_training(tmp_path / "b", 20)
    resumed, _ = tiny_training(tmp_path / "b", 40, resume=True)
    assert resumed[-1] == straight[-1]
    a, b = load_eagle(tmp_path / "a", decoder.config), load_eagle(tmp_path / "b", decoder.config)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_prefix_caching_is_off_by_default_and_refused_when_asked():
    """The head reads every prompt position's features after prefill; a cached prefix has none."""
    decoder = tiny_model(seed=1, dtype=torch.float32)
    head = random_head(head_config(decoder))
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, adaptive=False)

    native = quantize_(tiny_model(seed=1, dtype=torch.float32), "int8", dense_prefill=False, native=True)
    assert Engine(loaded(native), None, max_model_len=64, prefix_caching=None).prefix_caching  # on without it
    assert not Engine(loaded(native), spec, max_model_len=64, drafter=EagleDrafter(head, native.embed, 64),
                      prefix_caching=None).prefix_caching
    with pytest.raises(ValueError, match="every prompt position's hidden states"):
        Engine(loaded(decoder), spec, max_model_len=64, drafter=EagleDrafter(head, decoder.embed, 64),
               prefix_caching=True)
