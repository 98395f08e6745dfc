"""The EAGLE-3 head: its layer, its checkpoints in the public layouts, and its Q8_0 form.

EAGLE-3 (Li et al., 2025) drafts with one small decoder layer that reads, besides a token's
embedding, the target's hidden states. Notation: the target's input at position t is x_t, and
f_t = [h^low_t, h^mid_t, h^high_t] are its hidden states there, from three layers (the engine's
``hidden_layers``: index 0 is the embeddings, i the stream after layer i). f_t is what the
target knew when it predicted x_{t+1}. The head's input at position t pairs f_t with that token:

    g_t   = fc(f_t)                                    # 3 * H_target -> H
    a_t   = [input_norm(embed(x_{t+1})), hidden_norm(g_t)]            # 2H
    r_t   = g_t + o_proj(attention(q, k, v from a_t; RoPE at position t))
    o_t   = r_t + mlp(post_attn_norm(r_t))             # the head's output state (pre-norm)
    q(x_{t+2}) = softmax(lm_head(norm(o_t)))           # over the draft vocabulary

(``norm_before_residual``: the residual is ``hidden_norm(g_t)`` instead of ``g_t``.) To draft
further, o_t stands in for the target features it does not have: the next input pairs
embed(d_1) with o_t at position t + 1 (no ``fc``), and so on. The layer is written for any
attention: the drafter (:mod:`verispec.speculative.eagle`) attends over its own KV cache,
training (:mod:`verispec.train.losses`) over unrolled steps.

**Reduced vocabulary.** The LM head may cover a subset of the target's vocabulary
(``draft_vocab_size``); draft id i is target id ``i + d2t[i]``. A target token outside the
subset has q = 0 and is never proposed; verification is unchanged (it is exact for any q).

**Checkpoints.** Two public layouts are read (``config.json`` and safetensors weights):

* SpecForge (``architectures: ["LlamaForCausalLMEagle3"]``): a Llama config plus
  ``draft_vocab_size``, ``target_hidden_size`` (optional) and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (optional). Weights ``fc.weight``,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, and ``embed_tokens.weight`` when the
  head has its own embedding (else it uses the target's). Layer ids name the layer whose
  *output* is read (SGLang adds one), so id i is hidden-state index i + 1.
* vLLM ``speculators`` (``speculators_model_type: "eagle3"``): the Llama config under
  ``transformer_layer_config``; ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual`` (default true) and ``eagle_aux_hidden_state_layer_ids`` at the top
  level; the layer's weights under ``layers.0.`` instead of ``midlayer.``. Layer ids name the
  layer whose *input* is read (vLLM's convention), so id i is hidden-state index i.

Without layer ids, the head reads indices (2, L // 2, L - 3) of an L-layer target, the default
of both projects. :func:`save_eagle` writes the speculators layout.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from verispec import kernels
from verispec.models.decoder import RMSNorm, _rotate_half
from verispec.models.native import NativeLinear


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target's hidden-state indices fused by fc (module doc)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    attention_bias: bool = False
    own_embedding: bool = False  # else the target's embedding table

    def __post_init__(self) -> None:
        if len(self.aux_layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses three target layers, got {list(self.aux_layers)}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The hidden-state indices an EAGLE-3 head reads by default: (2, L // 2, L - 3), kept
    inside 1..L - 1 for small models."""
    last = max(num_layers - 1, 1)
    return min(2, last), min(max(num_layers // 2, 1), last), min(max(num_layers - 3, 1), last)


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft layer (module doc), float32. ``forward`` is written for any attention:
    the drafter attends over its KV cache, training over unrolled steps."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        h, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=False)
        self.embed = nn.Embedding(c.vocab_size, h) if c.own_embedding else None
        self.input_norm, self.hidden_norm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, q_out, bias=c.attention_bias)
        self.k_proj = nn.Linear(2 * h, kv_out, bias=c.attention_bias)
        self.v_proj = nn.Linear(2 * h, kv_out, bias=c.attention_bias)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.post_attn_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        # On the native kernels (quantize_head_): q/k/v as one product, gate/up as another.
        self.qkv_fused: nn.Module | None = None
        self.gate_up_fused: nn.Module | None = None
        d = c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, d, 2).float() / d)),
                             persistent=False)
        self.requires_grad_(True)

    # ---- the layer ----------------------------------------------------------------------------

    def qkv(self, embeds: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """embeds, hidden ``[B, T, H]`` (hidden already in the head's space), positions ``[B, T]``:
        q ``[B, nh, T, D]``, k and v ``[B, nkv, T, D]`` (RoPE applied), and the residual."""
        c = self.config
        if c.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        a = torch.cat([self.input_norm(embeds), hidden], dim=-1)  # [B, T, 2H]
        b, t, _ = a.shape
        if self.qkv_fused is not None:
            q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            q, k, v = self.qkv_fused(a).split((q_out, kv_out, kv_out), dim=-1)
        else:
            q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
        q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        cos, sin = emb.cos(), emb.sin()
        return _rope(q, cos, sin), _rope(k, cos, sin), v, residual

    def finish(self, attn: Tensor, residual: Tensor) -> Tensor:
        """attn ``[B, nh, T, D]``: the output state o ``[B, T, H]`` (pre-norm)."""
        b, _, t, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(b, t, -1)
        if self.gate_up_fused is not None:  # the kernels add the residuals, norm and gate themselves
            r = self.o_proj(attn, residual=residual)
            return self.down_proj(self.gate_up_fused(r, norm=self.post_attn_norm), glu=True, residual=r)
        r = residual + self.o_proj(attn)
        x = self.post_attn_norm(r)
        return r + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, out: Tensor) -> Tensor:
        """Draft-vocabulary logits ``[..., V_draft]`` of output states ``[..., H]``."""
        return self.lm_head(self.norm(out))

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: Tensor) -> Tensor:
        """``[..., V_draft]`` -> ``[..., V]``, -inf outside the draft vocabulary."""
        if self.config.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any()):
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.target_ids(torch.arange(logits.shape[-1], device=logits.device))] = logits
        return out


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin  # as the target's layers apply it


# ---- checkpoints ---------------------------------------------------------------------------------

_LAYER_KEYS = {  # our parameter -> the layer's name in both layouts (after midlayer. / layers.0.)
    "input_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "q_proj.bias": "self_attn.q_proj.bias",
    "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.bias": "self_attn.v_proj.bias",
    "o_proj.weight": "self_attn.o_proj.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
_TOP_KEYS = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             "embed.weight": "embed_tokens.weight", "d2t": "d2t"}


def _layout_names(head: Eagle3Head, prefix: str) -> dict[str, str]:
    """Our state-dict names -> the checkpoint's, for this head's parameters."""
    names = {}
    for ours in head.state_dict():
        if ours in _TOP_KEYS:
            names[ours] = _TOP_KEYS[ours]
        elif ours in _LAYER_KEYS:
            names[ours] = prefix + _LAYER_KEYS[ours]
    return names


def _read_config(directory: Path, target_config) -> tuple[EagleConfig, str]:
    """The head's config from either layout (module doc) and its layer prefix."""
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} is not an EAGLE-3 checkpoint: it has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"{path}: speculators_model_type {raw['speculators_model_type']!r} is not supported "
                             "(only eagle3)")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{path}: a speculators checkpoint needs a transformer_layer_config object")
        ids, offset, prefix = raw.get("eagle_aux_hidden_state_layer_ids"), 0, "layers.0."
        norm_before = bool(raw.get("norm_before_residual", True))
        top = raw
    elif "LlamaForCausalLMEagle3" in (raw.get("architectures") or []):
        layer = raw
        ids, offset, prefix = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), 1, "midlayer."
        norm_before = bool(raw.get("norm_before_residual", False))
        top = raw
    else:
        raise ValueError(f"{path} is neither a SpecForge EAGLE-3 config (architectures LlamaForCausalLMEagle3) "
                         'nor a speculators one (speculators_model_type "eagle3")')
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{path}: heads of {layer['num_hidden_layers']} layers are not supported (one layer)")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        config = EagleConfig(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=int(layer.get("vocab_size") or target_config.vocab_size),
            draft_vocab_size=int(top.get("draft_vocab_size") or layer.get("draft_vocab_size")
                                 or layer.get("vocab_size") or target_config.vocab_size),
            target_hidden_size=int(top.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
            aux_layers=tuple(int(i) + offset for i in ids) if ids else default_aux_layers(target_config.num_layers),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            norm_before_residual=norm_before,
            attention_bias=bool(layer.get("attention_bias", False)),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: missing or bad field {e}") from None
    return config, prefix


def _read_weights(directory: Path) -> dict[str, Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(load_file(str(f)))
    elif (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{directory} has no *.safetensors or pytorch_model.bin weights")
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_eagle(directory: str | Path, target_config) -> Eagle3Head:
    """Read an EAGLE-3 head in either public layout (module doc), checked against the target's
    config (a :class:`~verispec.models.decoder.DecoderConfig`). Raises ``ValueError`` with what
    is wrong."""
    directory = Path(directory)
    config, prefix = _read_config(directory, target_config)
    state = _read_weights(directory)
    if "embed_tokens.weight" in state:
        config = EagleConfig(**{**asdict(config), "own_embedding": True})
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{directory}: the head's vocabulary ({config.vocab_size}) is not the target's "
                         f"({target_config.vocab_size})")
    if config.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"{directory}: the head reads features of size {config.target_hidden_size}, the target's "
                         f"are {target_config.hidden_size}")
    bad = [i for i in config.aux_layers if not 0 <= i <= target_config.num_layers]
    if bad:
        raise ValueError(f"{directory}: hidden-state indices {bad} are outside the target's 0..{target_config.num_layers}")
    head = Eagle3Head(config)
    names = _layout_names(head, prefix)
    optional = {"d2t"} if config.draft_vocab_size == config.vocab_size else set()
    missing = sorted(theirs for ours, theirs in names.items() if theirs not in state and ours not in optional)
    known = set(names.values()) | {"t2d"}
    unexpected = sorted(set(state) - known)
    if missing or unexpected:
        raise ValueError(f"{directory}: EAGLE-3 weights do not match the config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    own = head.state_dict()
    with torch.no_grad():
        for ours, theirs in names.items():
            if theirs not in state:
                continue
            if tuple(state[theirs].shape) != tuple(own[ours].shape):
                raise ValueError(f"{directory}: {theirs} has shape {list(state[theirs].shape)}, the config needs "
                                 f"{list(own[ours].shape)}")
            own[ours].copy_(state[theirs])
    ids = head.target_ids(torch.arange(config.draft_vocab_size))
    if bool((ids < 0).any()) or bool((ids >= config.vocab_size).any()) or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"{directory}: d2t does not map the draft vocabulary into distinct target ids")
    return head


def save_eagle(head: Eagle3Head, directory: str | Path, verifier: str = "", speculative_tokens: int = 4) -> Path:
    """Write ``head`` in the vLLM speculators layout (module doc)."""
    c = head.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama", "num_hidden_layers": 1, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "attention_bias": c.attention_bias,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "speculators_config": {"algorithm": "eagle3",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": speculative_tokens}],
                               "verifier": {"name_or_path": verifier}},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = head.state_dict()
    weights = {theirs: state[ours].contiguous() for ours, theirs in _layout_names(head, "layers.0.").items()}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.target_ids(torch.arange(c.draft_vocab_size))] = True
    weights["t2d"] = t2d
    save_file(weights, str(directory / "model.safetensors"))
    return directory


# ---- Q8_0 on the native kernels ----------------------------------------------------------------

HEAD_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def quantize_head_(head: Eagle3Head) -> list[str]:
    """Run the head's linear layers on the native kernels as Q8_0 (gguf's reference quantizer),
    where the kernels take their shape; returns the layers converted. A drafter's weights only
    change what it proposes, never what verification accepts, so this is a question of speed
    (a one-layer head for the 1.5B target reads about 4x fewer bytes than in float32)."""
    if not kernels.available() or head.lm_head.weight.device.type != "cpu":
        return []
    done = []
    fmt = kernels.FORMATS["Q8_0"]
    for name in HEAD_LINEARS:
        lin = getattr(head, name)
        try:
            kernels.check_format(fmt, lin.out_features, lin.in_features)
        except kernels.KernelError:
            continue
        raw = quants.quantize(lin.weight.detach().float().numpy(), GGMLQuantizationType(fmt))
        part = kernels.repack(fmt, raw, lin.out_features, lin.in_features)
        bias = None if lin.bias is None else lin.bias.detach().float()
        setattr(head, name, NativeLinear([part], bias, None, float_output=True))
        done.append(name)
    if {"q_proj", "k_proj", "v_proj"} <= set(done):
        biases = [head.q_proj.bias, head.k_proj.bias, head.v_proj.bias]
        head.qkv_fused = NativeLinear(head.q_proj.parts + head.k_proj.parts + head.v_proj.parts,
                                      None if biases[0] is None else torch.cat(biases), None, float_output=True)
    if {"gate_proj", "up_proj", "o_proj", "down_proj"} <= set(done):
        head.gate_up_fused = NativeLinear(head.gate_proj.parts + head.up_proj.parts, None, None, float_output=True)
    return done
