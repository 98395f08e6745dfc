"""``medusa``: K heads over the target's last hidden state propose the next K tokens.

Medusa (Cai et al., 2024) puts K small heads on the target's final (normed) hidden state. Let
h_t be the state at the input whose logits gave the last committed token x. The target's own
LM head on h_t predicted x; head i (0-based) predicts the token i + 1 places after x:

    head_i(h) = W_i^head (r_i^L(...(r_i^1(h))))        r(x) = x + SiLU(W x + b)   (a ResBlock)

Each head has L ResBlocks and its own LM head (``[V, H]``), or shares the target's (a
checkpoint without head weights). Heads read h_t only, never the drafts before them, so every
head's distribution is fixed before the round: chains and trees are verified exactly with the
usual rules (q_i is the sampling transform of head i's logits, p the target's). The drafter
needs one hidden state per round, which the engine hands over in ``seq.target_hidden`` (the
``hidden_layers`` it declares): no second target pass.

Proposals:

* **chain** (default): token i is head i's argmax at T = 0, else a draw from q_i.
* **static tree** (``speculative_token_tree``, Medusa's choices): a node of rank r at depth d
  is the r-th most likely token of head d - 1. Children are top-k (deterministic), which is
  exact at any temperature.
* **dynamic tree** (``speculative_eagle_topk`` > 1): every node's children are the top-k tokens
  of the next head. A node's value is the product of its path's head probabilities, and the
  ``num_draft_tokens`` best nodes are kept, best first. Since values never grow along a path,
  they form a tree, and the adaptive controller may verify a prefix (``Proposal.values``).

Checkpoints use the FasterDecoding/Medusa layout: a directory with ``config.json``
(``medusa_num_heads``, ``medusa_num_layers``) and ``medusa_lm_head.safetensors`` (or
``medusa_lm_head.pt``), whose keys are ``{i}.{j}.linear.weight`` ``[H, H]`` and
``{i}.{j}.linear.bias`` ``[H]`` for the ResBlocks j < L of head i, and ``{i}.{L}.weight``
``[V, H]`` for its LM head. :func:`save_medusa` writes the same layout (safetensors).

**A reduced draft vocabulary** (verispec's extension, as EAGLE-3's): heads may score only
``draft_vocab_size`` tokens (``config.json``), with a ``d2t`` offset table in the weights (draft
id i is target id ``i + d2t[i]``). Shared heads then read the target's LM-head rows for those
tokens only, and own heads are ``[V_draft, H]``. A CPU pays for the LM head in every round (each
head's logits are a product with it), and in training for every position: 151,936 rows for the
1.5B target against, say, 16,384. Drafts are target ids; a token outside the draft vocabulary
has q = 0, which verification handles like any other zero (such a token is never proposed).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from verispec import kernels
from verispec.models.lm_head import lm_head_weight
from verispec.models.native import NativeLinear
from verispec.sequence import Sequence
from verispec.sampling import logits_to_probs
from verispec.speculative.base import Drafter, DrafterContext, Outcome, Proposal
from verispec.speculative.tree import Tree

WEIGHTS_SAFETENSORS = "medusa_lm_head.safetensors"
WEIGHTS_TORCH = "medusa_lm_head.pt"


class MedusaHeads(nn.Module):
    """K Medusa heads: ``forward(h [n, H]) -> logits [K, n, V_draft]``, in float32 throughout
    (``V_draft`` = ``vocab_size`` unless the heads have a reduced draft vocabulary). Heads
    without LM heads of their own take the target's (its rows for the draft vocabulary) as
    ``shared_head``."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_heads: bool = True, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, draft_vocab_size, bias=False)
                                      for _ in range(num_heads)) if own_lm_heads else None
        # draft id i is target id i + d2t[i] (EAGLE-3's convention); all zeros for the full vocabulary
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    @property
    def reduced(self) -> bool:
        """Whether the heads score a reduced draft vocabulary (not every target token, in order)."""
        return self.draft_vocab_size != self.vocab_size or bool(self.d2t.any())

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: Tensor) -> Tensor:
        """``[..., V_draft]`` -> ``[..., V]``, -inf outside the draft vocabulary."""
        if not self.reduced:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.target_ids(torch.arange(logits.shape[-1], device=logits.device))] = logits
        return out

    def draft_labels(self, target_ids: Tensor) -> Tensor:
        """Target ids -> draft ids, -100 (cross-entropy's ignore index) outside the draft vocabulary."""
        if not self.reduced:
            return target_ids
        to_draft = torch.full((self.vocab_size,), -100, dtype=torch.long, device=target_ids.device)
        to_draft[self.target_ids(torch.arange(self.draft_vocab_size, device=target_ids.device))] = torch.arange(
            self.draft_vocab_size, device=target_ids.device)
        return to_draft[target_ids]

    def features(self, h: Tensor, num_heads: int | None = None) -> Tensor:
        """The ResBlocks of the first ``num_heads`` heads (default all K): ``[n, H] -> [K, n, H]``."""
        out = []
        for blocks in self.blocks[:num_heads]:
            x = h
            for block in blocks:
                x = x + nn.functional.silu(block(x))
            out.append(x)
        return torch.stack(out)

    def forward(self, h: Tensor, shared_head: Callable[[Tensor], Tensor] | None = None,
                num_heads: int | None = None) -> Tensor:
        """Logits of the first ``num_heads`` heads (default all): a round drafting fewer tokens
        than there are heads pays only for the heads it uses."""
        x = self.features(h.float(), num_heads)  # [K', n, H]
        if self.lm_heads is not None:
            return torch.stack([head(x[i]) for i, head in zip(range(len(x)), self.lm_heads)])
        if shared_head is None:
            raise ValueError("these Medusa heads share the target's LM head: pass it as shared_head")
        return shared_head(x).float()

    def init_from_target(self, lm_weight: Tensor) -> None:
        """Medusa's initialisation: ResBlocks are the identity (zero weights), LM heads copy
        the target's (``lm_weight`` ``[V_draft, H]``: its rows for the draft vocabulary)."""
        for blocks in self.blocks:
            for block in blocks:
                nn.init.zeros_(block.weight)
                nn.init.zeros_(block.bias)
        if self.lm_heads is not None:
            for head in self.lm_heads:
                head.weight.data.copy_(lm_weight)


def _layout_state(heads: MedusaHeads) -> dict[str, Tensor]:
    state = {}
    for i in range(heads.num_heads):
        for j, block in enumerate(heads.blocks[i]):
            state[f"{i}.{j}.linear.weight"] = block.weight.data
            state[f"{i}.{j}.linear.bias"] = block.bias.data
        if heads.lm_heads is not None:
            state[f"{i}.{heads.num_layers}.weight"] = heads.lm_heads[i].weight.data
    if heads.reduced:
        state["d2t"] = heads.d2t
    return state


def save_medusa(heads: MedusaHeads, directory: str | Path, base_model: str = "") -> Path:
    """Write ``heads`` in the FasterDecoding layout (``config.json`` and safetensors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
              "base_model_name_or_path": base_model}
    if heads.reduced:
        config["draft_vocab_size"] = heads.draft_vocab_size
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in _layout_state(heads).items()}, str(directory / WEIGHTS_SAFETENSORS))
    return directory


def load_medusa(directory: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Read Medusa heads in the FasterDecoding layout (module doc), checked against the target's
    hidden and vocabulary sizes. Raises ``ValueError`` with what is wrong."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} is not a Medusa checkpoint: it has no config.json")
    config = json.loads(config_path.read_text())
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        draft_vocab_size = int(config.get("draft_vocab_size", vocab_size))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{config_path} needs an integer medusa_num_heads (and medusa_num_layers, "
                         "draft_vocab_size)") from None
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"{config_path}: draft_vocab_size {draft_vocab_size} is outside the target's "
                         f"vocabulary of {vocab_size}")
    if (directory / WEIGHTS_SAFETENSORS).is_file():
        state = load_file(str(directory / WEIGHTS_SAFETENSORS))
    elif (directory / WEIGHTS_TORCH).is_file():
        state = torch.load(directory / WEIGHTS_TORCH, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{directory} has neither {WEIGHTS_SAFETENSORS} nor {WEIGHTS_TORCH}")
    own = all(f"{i}.{num_layers}.weight" in state for i in range(num_heads))
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, own_lm_heads=own,
                        draft_vocab_size=draft_vocab_size)
    if draft_vocab_size < vocab_size and "d2t" not in state:
        raise ValueError(f"{directory}: draft_vocab_size {draft_vocab_size} needs a d2t table in the weights")
    expected = _layout_state(heads)
    if "d2t" in state:
        expected["d2t"] = heads.d2t
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: Medusa weights do not match {num_heads} heads of {num_layers} "
                         f"layer(s): missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{directory}: {name} has shape {list(state[name].shape)}, the target needs "
                             f"{list(tensor.shape)} (hidden {hidden_size}, vocabulary {vocab_size})")
        tensor.copy_(state[name] if name == "d2t" else state[name].float())
    ids = heads.target_ids(torch.arange(draft_vocab_size))
    if bool((ids < 0).any()) or bool((ids >= vocab_size).any()) or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"{directory}: d2t does not map the draft vocabulary into distinct target ids")
    return heads


class MedusaDrafter(Drafter):
    """Chain or tree proposals from :class:`MedusaHeads` (module doc)."""

    hidden_layers = (-1,)  # the final normed hidden state, the one the LM head reads
    last_prompt_state_only = True  # `start` reads the last prompt position's: prefix caching stays on

    def __init__(self, heads: MedusaHeads, *, tree: Tree | None = None, topk: int = 1,
                 budget: int | None = None, target_head: Callable[[Tensor], Tensor] | None = None) -> None:
        self.heads = heads.eval().requires_grad_(False)
        self.target_head = target_head  # for heads that share the target's LM head
        self.static = tree
        self.topk = topk
        self.budget = budget
        self._hidden: dict[int, Tensor] = {}  # slot -> h of the last committed token's input [H]

    # ---- the drafter protocol ----------------------------------------------------------------

    def start(self, seq: Sequence) -> None:
        self._hidden[seq.slot] = seq.target_hidden[-1]

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        self._hidden[seq.slot] = seq.target_hidden[-1]

    def finish(self, seq: Sequence) -> None:
        self._hidden.pop(seq.slot, None)

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> Proposal:
        depth = min(k, self.heads.num_heads)
        logits = self.heads(self._hidden[seq.slot][None], self.target_head, depth)[:, 0]  # [depth, V_draft]
        logits = self.heads.target_logits(logits)  # [depth, V]
        if self.static is not None:
            return self._static(seq, logits, depth)
        if self.topk > 1:
            return self._dynamic(seq, logits, depth)
        return self._chain(seq, logits)

    # ---- proposals ---------------------------------------------------------------------------

    def _dist(self, seq: Sequence, logits: Tensor) -> Tensor:
        """q per head: the request's sampling transform; at T = 0 the softmax (for tree values)."""
        p = seq.params
        if p.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p, p.min_p)[0]

    def _chain(self, seq: Sequence, logits: Tensor) -> Proposal:
        if seq.params.greedy:
            return Proposal(logits.argmax(dim=-1).tolist())
        q = self._dist(seq, logits)  # [depth, V]
        tokens = torch.multinomial(q, 1, generator=seq.generator)[:, 0]
        return Proposal(tokens.tolist(), q)

    def _static(self, seq: Sequence, logits: Tensor, depth: int) -> Proposal:
        tree = self.static
        keep = [i for i in range(1, len(tree)) if tree.depths[i] <= depth]
        if self.budget is not None:
            keep = keep[: self.budget]
        width = max(tree.ranks[i] for i in keep) + 1
        ranked = torch.topk(logits, min(width, logits.shape[-1]), dim=-1).indices.tolist()  # [depth, width]
        renumber = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
        tokens = [ranked[tree.depths[i] - 1][tree.ranks[i]] for i in keep]
        return Proposal(tokens, None, tuple(renumber[tree.parents[i]] for i in keep), "topk")

    def _dynamic(self, seq: Sequence, logits: Tensor, depth: int) -> Proposal:
        """Best-first: the ``budget`` nodes of highest path probability, each node's children
        being the next head's top-k tokens."""
        q = self._dist(seq, logits)  # [depth, V]
        top = torch.topk(q, self.topk, dim=-1)
        logp = top.values.clamp_min(1e-30).log().tolist()  # [depth, topk]
        tok = top.indices.tolist()
        budget = self.budget or depth * self.topk
        # frontier entries: (-log value, tie order, depth of the child, rank, parent node)
        frontier = [(-logp[0][r], r, 0, r, 0) for r in range(self.topk)]
        heapq.heapify(frontier)
        tokens, parents, values, scores = [], [], [], [0.0]
        order = self.topk
        while frontier and len(tokens) < budget:
            neg, _, d, r, parent = heapq.heappop(frontier)
            tokens.append(tok[d][r])
            parents.append(parent)
            values.append(math.exp(-neg))
            scores.append(-neg)
            node = len(tokens)
            if d + 1 < depth:
                for r2 in range(self.topk):
                    heapq.heappush(frontier, (-(scores[node] + logp[d + 1][r2]), order, d + 1, r2, node))
                    order += 1
        return Proposal(tokens, None, tuple(parents), "topk", values=tuple(values))


def quantize_heads_(heads: MedusaHeads, shared_rows: Tensor | None = None) -> Callable[[Tensor], Tensor] | None:
    """Run the heads' linear layers (ResBlocks, own LM heads) on the native kernels as Q8_0
    (gguf's reference quantizer), where the kernels take their shape. With ``shared_rows``
    (``[V_draft, H]``, the target's LM-head rows of a reduced draft vocabulary) also returns
    that product on the kernels, else None. As for an EAGLE-3 head: a drafter's weights only
    change what it proposes, never what verification accepts; float32 ResBlocks alone are
    9.4 MB per head for the 1.5B target, read in every round."""
    if not kernels.available():
        return None
    fmt = kernels.FORMATS["Q8_0"]

    def native(weight: Tensor, bias: Tensor | None) -> NativeLinear | None:
        n, k = weight.shape
        try:
            kernels.check_format(fmt, n, k)
        except kernels.KernelError:
            return None
        raw = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType(fmt))
        return NativeLinear([kernels.repack(fmt, raw, n, k)], None if bias is None else bias.detach().float(),
                            None, float_output=True)

    for blocks in heads.blocks:
        for j, block in enumerate(blocks):
            if block.weight.device.type == "cpu" and (lin := native(block.weight, block.bias)) is not None:
                blocks[j] = lin
    if heads.lm_heads is not None:
        for i, head in enumerate(heads.lm_heads):
            if head.weight.device.type == "cpu" and (lin := native(head.weight, None)) is not None:
                heads.lm_heads[i] = lin
    if shared_rows is None or shared_rows.device.type != "cpu":
        return None
    lin = native(shared_rows, None)
    return None if lin is None else (lambda x: lin(x.float()))


def make_medusa_drafter(config, context: DrafterContext) -> MedusaDrafter:
    if not config.model:
        raise ValueError('method "medusa" needs "model": a directory with Medusa heads (config.json and '
                         f"{WEIGHTS_SAFETENSORS} or {WEIGHTS_TORCH}); `verispec train-drafter --method "
                         "medusa` trains one")
    decoder = context.target.model
    heads = load_medusa(config.model, decoder.config.hidden_size, decoder.config.vocab_size)
    heads.to(decoder.device)
    if config.tree_children != "topk":
        raise ValueError("medusa trees take top-k children (tree_children 'topk'): its heads do not "
                         "condition on the path, so sampled children would add nothing")
    if config.quantization not in ("auto", "int8", "none"):
        raise ValueError(f"Medusa heads run in float32 (quantization none) or Q8_0 (auto, int8), "
                         f"not {config.quantization!r}")
    tree = None
    if config.speculative_token_tree is not None:
        tree = Tree.from_choices(config.speculative_token_tree)
    budget = config.tree_budget if config.is_tree else None

    shared_rows = None  # the target's LM-head rows for a reduced draft vocabulary, [V_draft, H]
    if heads.lm_heads is None and heads.reduced:
        shared_rows = lm_head_weight(decoder).detach()[heads.target_ids(torch.arange(heads.draft_vocab_size))].float()

    def target_head(x: Tensor) -> Tensor:
        if shared_rows is not None:
            return x.float() @ shared_rows.T
        return decoder.logits(x.to(decoder.dtype))

    head = target_head
    if config.quantization != "none" and decoder.device.type == "cpu":
        head = quantize_heads_(heads, shared_rows) or target_head
    return MedusaDrafter(heads, tree=tree, topk=config.speculative_eagle_topk, budget=budget, target_head=head)
