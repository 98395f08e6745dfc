"""``draft_model``: a separate small model with its own KV cache drafts autoregressively.

Draft cache bookkeeping for one round, with ``L0`` committed tokens before the round::

    cache holds      ids[:c]                 (c < L0: whatever it has not seen yet is fed now)
    propose k        feed ids[c:L0] -> q_1, d_1; feed d_1 -> q_2, d_2; ... feed d_{k-1} -> q_k, d_k
    cache holds      ids[:L0] + d_1..d_{k-1}  (d_k is never fed)
    a accepted       committed = d_1..d_a + x; keep ids[:L0] + d_1..d_min(a, k-1)

When all k drafts are accepted, d_k and the bonus token are both missing from the cache; the next
round feeds them together in its first forward, so catching up costs no extra pass. The same
catch-up reads the prompt on a request's first drafting round (``start`` reads nothing), and
whatever was committed during rounds that drafted nothing.

The prompt is read as the target read it: in one prefill pass, or, when the engine prefixes-caches
(it then prefills through the decode path, see :mod:`verispec.engine.engine`), through the
decode path too (:meth:`DraftModelDrafter.reads_prompts_as`). Then, if the draft's rows are
pass-invariant as well, a slot also keeps the draft's K/V of a finished request, and the next
request in that slot reads only what its prompt does not share with them.

The draft samples from q = logits_to_probs(draft logits) with the request's own sampling
settings and generator, and returns q with the tokens, so verification stays exact. With a cut
vocabulary (:class:`DraftVocabulary`) q is zero outside the kept ids, which changes acceptance
only: the rule is exact for any q. A request with penalties, ``logit_bias`` or ``min_tokens``
gets them on q as well (counting the output and this round's drafts, as the target's rows count
them: :func:`verispec.penalties.penalize_next`), so its drafts follow the penalised target.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from verispec import kernels
from verispec.config import DRAFT_HEAD_QUANTIZATIONS
from verispec.sequence import Sequence, common_prefix
from verispec.models.decoder import PREFILL_MIN_TOKENS, Decoder, invariant_linear
from verispec.models.native import NativeLinear, gguf_quantized
from verispec.models.registry import BUNDLED_MODELS
from verispec.penalties import penalize_next
from verispec.sampling import logits_to_probs, sample
from verispec.speculative.base import DraftCalibration, Drafter, Outcome, Proposal
from verispec.speculative.cost_model import relative_time

if TYPE_CHECKING:
    from verispec.models.loader import LoadedModel


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise if the draft's token ids do not mean the same strings as the target's."""
    t_vocab, d_vocab = target.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(t_vocab.keys() - d_vocab.keys())
        only_d = len(d_vocab.keys() - t_vocab.keys())
        moved = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok, i) != i)
        raise ValueError(
            f"draft model {draft.name!r} has a vocabulary incompatible with the target "
            f"{target.name!r}: {only_t} tokens only in the target, {only_d} only in the draft, "
            f"{moved} with different ids. Pick a draft that shares the target's tokenizer."
        )


class DraftVocabulary:
    """A draft model's LM head cut to part of the vocabulary (``draft_vocab_size``).

    The head scores the ids below ``size`` and the tokenizer's special tokens (end of turn, end of
    text: a draft that could not propose them could never draft the end of an answer); every
    other id gets -inf (:meth:`expand`), so q is zero there. Verification is exact for any q, so
    the output stays the target's; a target token outside the kept ids is never drafted, which
    costs acceptance only. What it saves is the head's weight reads, a large part of a small
    draft model's step: Qwen2.5-Coder-0.5B's tied head is 151,936 x 896 in Q8_0, 144 MB of the
    model's 392 MB read per token (docs/benchmarks/per-token-costs.md has the measurements).

    Kept ids are rounded out to whole tiles of the kernels' packed layout (16 ids) on a native
    head, so the cut head's parts are views of the full one's bytes; a dense or tied head keeps
    exactly the ids asked for. The cut head runs through the same kernels, so a kept id's logit
    is bit for bit the full head's.

    ``quantization="int4"`` (a native head only) goes further: the kept rows, as the kernels
    dequantize them, are requantized to Q4_1 by gguf's quantizer into a head of their own, which
    reads 0.625 bytes a weight (a Q8_0 head 1.06, a Q6_K one 0.82). Its logits are then close to
    the full head's, not equal: q changes, and with it acceptance, never the output.
    """

    def __init__(self, model: Decoder, size: int, special_ids: Iterable[int], target_vocab: int,
                 quantization: str = "none") -> None:
        """Keep ids below ``size`` and ``special_ids``, none at or past the draft's or the
        target's vocabulary size (``target_vocab``, the width of :meth:`expand`); store the kept
        head as loaded (``quantization="none"``) or requantized to Q4_1 (``"int4"``)."""
        head = model.lm_head
        if quantization not in DRAFT_HEAD_QUANTIZATIONS:
            raise ValueError(f"draft_head_quantization must be one of {', '.join(DRAFT_HEAD_QUANTIZATIONS)}, "
                             f"got {quantization!r}")
        if quantization == "int4" and not isinstance(head, NativeLinear):
            raise ValueError(f"draft_head_quantization 'int4' requantizes a head on the native kernels, and this "
                             f"draft's LM head is {type(head).__name__}; load the draft with its GGUF weights "
                             "(quantization 'auto' on the CPU) or leave draft_head_quantization unset")
        self.target_vocab = target_vocab
        vocab = min(model.config.vocab_size, target_vocab)
        align = kernels.TILE if isinstance(head, NativeLinear) else 1
        wanted = [(0, min(size, vocab))] + [(i, i + 1) for i in sorted(special_ids) if 0 <= i < vocab]
        ranges: list[tuple[int, int]] = []
        for a, b in wanted:  # [a, b) rounded out to whole tiles, merged where they meet
            a, b = a // align * align, min(-(-b // align) * align, vocab)
            if a >= b:
                continue
            if ranges and a <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], b))
            else:
                ranges.append((a, b))
        self.ranges = ranges  # kept ids, in id order
        self.size = sum(b - a for a, b in ranges)
        if isinstance(head, NativeLinear):
            self.head: nn.Module | None = _cut_native(head, ranges)
            if quantization == "int4":
                self.head = _requantized(self.head, "Q4_1")
        elif head is None or isinstance(head, nn.Linear):
            self.head = None  # dense rows, multiplied range by range (views, no copies)
            self.weight, self.bias = (model.embed.weight, None) if head is None else (head.weight, head.bias)
        else:
            raise ValueError(f"draft_vocab_size: the draft's LM head ({type(head).__name__}) cannot be cut; "
                             "leave draft_vocab_size unset for this draft model")

    def __call__(self, x: Tensor) -> Tensor:
        """Normed hidden states ``[..., hidden]`` -> float32 logits of the kept ids ``[..., size]``."""
        if self.head is not None:
            return self.head(x).float()
        parts = [invariant_linear(x, self.weight[a:b], None if self.bias is None else self.bias[a:b])
                 for a, b in self.ranges]
        return torch.cat(parts, dim=-1).float()

    def expand(self, logits: Tensor) -> Tensor:
        """``[..., size]`` -> ``[..., target_vocab]``, -inf at every id not kept.

        Example: ranges [(0, 4), (8, 10)], target_vocab 12: logits [l0 l1 l2 l3 l8 l9] ->
        [l0 l1 l2 l3 -inf -inf -inf -inf l8 l9 -inf -inf]."""
        out = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        offset = 0
        for a, b in self.ranges:
            out[..., a:b] = logits[..., offset : offset + b - a]
            offset += b - a
        return out

    def token(self, index: int) -> int:
        """The token id at ``index`` of the kept logits (e.g. their argmax: ties go to the lowest
        id, as in the whole vocabulary's argmax, since the kept ids are in id order)."""
        for a, b in self.ranges:
            if index < b - a:
                return a + index
            index -= b - a
        raise IndexError(f"index past the {self.size} kept ids")


def _cut_native(head: NativeLinear, ranges: list[tuple[int, int]]) -> NativeLinear:
    """The rows ``ranges`` (whole tiles) of a native head, as views of its packed parts."""
    parts, offset = [], 0
    for p in head.parts:
        tile_bytes = p.nbytes // (p.n // kernels.TILE)
        for a, b in ranges:
            lo, hi = max(a, offset), min(b, offset + p.n)
            if lo < hi:
                data = p.data[(lo - offset) // kernels.TILE * tile_bytes : (hi - offset) // kernels.TILE * tile_bytes]
                parts.append(kernels.PackedWeight(p.fmt, hi - lo, p.k, data))
        offset += p.n
    bias = None if head.bias is None else torch.cat([head.bias[a:b] for a, b in ranges])
    return NativeLinear(parts, bias, None, float_output=True, join=False)


def _requantized(head: NativeLinear, fmt_name: str) -> NativeLinear:
    """``head``'s weight as the kernels multiply by it, quantized to ``fmt_name`` (a 32-wide
    format) by gguf's own quantizer (a copy; ``head`` is left as it is)."""
    if head.in_features % 32:
        raise ValueError(f"draft_head_quantization: {fmt_name} needs a hidden size that is a multiple of 32, "
                         f"and this draft's is {head.in_features}")
    return gguf_quantized(head.dequantize(), head.bias, fmt_name, head=True)


def bundled_draft_head_quantization(name: str) -> str | None:
    """The ``draft_head_quantization`` a bundled model drafts with by default (None: as loaded)."""
    model = BUNDLED_MODELS.get(name)
    return None if model is None else model.draft_head_quantization


def bundled_draft_vocab_size(name: str) -> int | None:
    """The ``draft_vocab_size`` a bundled model drafts with by default (None: its whole vocabulary)."""
    model = BUNDLED_MODELS.get(name)
    return None if model is None else model.draft_vocab_size


# Catch-up passes over generated tokens are short, like the target's verify passes (they are not
# marked as a prefill, so this is not needed for exactness, only to keep them cheap to compile).
DECODE_CHUNK = PREFILL_MIN_TOKENS - 1


class DraftModelDrafter(Drafter):
    stops_within_round = True  # a chain that stops where the bound rule says (bind_stop)

    def __init__(self, draft: LoadedModel, target_vocab: int, max_model_len: int, num_slots: int = 1,
                 draft_vocab_size: int | None = None, draft_head_quantization: str | None = None) -> None:
        """``draft_vocab_size`` and ``draft_head_quantization``: see :class:`DraftVocabulary`;
        None takes the bundled model's own setting (:func:`bundled_draft_vocab_size`,
        :func:`bundled_draft_head_quantization`), else the whole vocabulary, stored as loaded. A
        bundled setting of ``"int4"`` is dropped for a head off the native kernels (a dense
        draft), where asking for it is an error."""
        self.model = draft.model
        self.target_vocab = target_vocab
        vocab_size = self.model.config.vocab_size
        size = bundled_draft_vocab_size(draft.name) if draft_vocab_size is None else draft_vocab_size
        head_quantization = draft_head_quantization
        if head_quantization is None:
            head_quantization = bundled_draft_head_quantization(draft.name) or "none"
            if not isinstance(self.model.lm_head, NativeLinear):
                head_quantization = "none"
        special = set(getattr(draft.tokenizer.hf, "added_tokens_decoder", {})) | set(draft.tokenizer.eos_token_ids)
        cut = size is not None and size < vocab_size
        self.vocab = (DraftVocabulary(self.model, size if cut else vocab_size, special, target_vocab, head_quantization)
                      if cut or head_quantization != "none" else None)
        self.cache = self.model.new_cache(max_model_len, num_slots=num_slots)
        self._round_start: dict[int, tuple[int, int]] = {}  # slot -> (L0, k) of the last proposal
        self.prompt_prefill = True  # the prompt in one prefill pass (see reads_prompts_as)
        self.kept: list[list[int]] = [[] for _ in range(num_slots)]  # per slot, the tokens its cache still holds
        self._owner: dict[int, Sequence] = {}  # slot -> the request start() read it for
        self._keep: Callable[[Sequence, int, float], bool] | None = None  # see bind_stop

    def bind_stop(self, keep: Callable[[Sequence, int, float], bool] | None) -> None:
        """Stop a round's chain early: after each draft but the last asked for, ``keep(seq, n,
        value)`` says whether to draft one more, given the ``n`` drafts so far and ``value``,
        the draft's probability of them all (greedy: the product of each argmax's softmax
        probability; sampled: of each drawn token's q). The engine binds its controller's rule
        (:meth:`~verispec.speculative.controller.AdaptiveController.keep_drafting`); None drafts
        every token asked for.

        Exact at every temperature: the stop depends only on drafts already made, so each draft
        is verified as in any chain, and a chain that stops ends in a bonus token drawn from p.
        """
        self._keep = keep

    def reads_prompts_as(self, prefill: bool) -> None:
        """How the target reads prompts: ``prefill=True``, one prefill pass; ``False``, the decode
        path (an engine with prefix caching). The draft reads them alike, so that a model
        drafting for itself reproduces the target; on the decode path it also keeps a finished
        request's K/V for the next request in the slot, where its rows are pass-invariant."""
        self.prompt_prefill = prefill
        if prefill or not self.model.rows_are_pass_invariant():
            self.kept = [[] for _ in self.kept]

    @property
    def _keeps(self) -> bool:
        return not self.prompt_prefill and self.model.rows_are_pass_invariant()

    def start(self, seq: Sequence) -> None:
        """Read nothing yet: the first :meth:`propose` feeds the draft everything it has not
        seen (the prompt included) in one pass. A request that never drafts (speculation off
        for it, or k = 0 whenever it runs, as in a large batch) never pays the draft's prefill.
        Where the slot kept an earlier request's K/V, the prefix it shares with the prompt stays."""
        slot = seq.slot
        shared = common_prefix(self.kept[slot], seq.prompt_ids) if self._keeps else 0
        self.kept[slot] = []
        self._owner[slot] = seq
        if shared:
            self.cache.truncate(slot, shared)
        else:
            self.cache.reset(slot)

    def catch_up(self, seq: Sequence) -> None:
        """Read what the draft has not seen, except the last committed token, in the passes the
        target used: the prompt in one (its prefill), generated tokens in passes short enough to
        stay on the decode path (their rows equal one-token steps bitwise). So the draft's cache
        matches what reading the tokens one round at a time would have built; drafting with the
        target itself then reproduces the target exactly."""
        slot = seq.slot
        start, stop = self.cache.length(slot), seq.num_tokens - 1
        if stop - start <= 1:
            return  # a usual round: its first forward feeds the (at most two) new tokens together
        t0 = time.perf_counter()
        ids = seq.token_ids
        bounds = [len(seq.prompt_ids)] if start < len(seq.prompt_ids) < stop else []
        bounds += list(range(max(start, len(seq.prompt_ids)) + DECODE_CHUNK, stop, DECODE_CHUNK)) + [stop]
        for end in bounds:
            if end > start:
                # the prompt in one pass from the start, as the target's prefill read it
                self._next_logits(slot, ids[start:end],
                                  prefill=self.prompt_prefill and start == 0 and end == len(seq.prompt_ids))
                start = end
        seq.metrics.catch_up_time_s += time.perf_counter() - t0  # part of the round's drafting time

    def propose(self, seq: Sequence, k: int) -> Proposal:
        self.catch_up(seq)
        ids = seq.token_ids
        feed = ids[self.cache.length(seq.slot):]  # the last committed token (and a bonus one)
        p = seq.params
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        keep, value = self._keep, 1.0
        for _ in range(k):
            logits = self._next_logits(seq.slot, feed)  # [V_draft], or [V_kept] with a cut vocabulary
            if p.changes_logits:  # the request's penalties on q too, so that drafts follow the penalised target
                x = penalize_next(seq, tokens, self._align_vocab(logits))  # [V_target]
                q = torch.softmax(x, dim=-1) if p.greedy else logits_to_probs(x, p.temperature, p.top_k, p.top_p, p.min_p)
                tok = int(x.argmax()) if p.greedy else int(sample(q, seq.generator))
                if not p.greedy:
                    probs.append(q)
                value *= float(q[tok])
            elif p.greedy and keep is None:
                tok = self._argmax(logits)
            elif p.greedy:
                tok, prob = self._argmax_prob(logits)
                value *= prob
            else:
                q = logits_to_probs(self._align_vocab(logits), p.temperature, p.top_k, p.top_p, p.min_p)  # [V_target]
                tok = int(sample(q, seq.generator))
                probs.append(q)
                value *= float(q[tok])
            tokens.append(tok)
            feed = [tok]
            if keep is not None and len(tokens) < k and not keep(seq, len(tokens), value):
                break
        self._round_start[seq.slot] = (len(ids), len(tokens))
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        round_start = self._round_start.pop(seq.slot, None)
        if round_start is None:
            return  # the engine asked for no drafts this round; the next propose catches up
        start, k = round_start
        self.cache.truncate(seq.slot, start + min(outcome.num_accepted, k - 1))

    def finish(self, seq: Sequence) -> None:
        slot = seq.slot
        round_start = self._round_start.pop(slot, None)
        if self._owner.pop(slot, None) is not seq:
            return  # finished in its prefill: start never ran, the slot still holds what it kept
        # the committed tokens the cache holds: past a round's start it may hold drafts the
        # round did not keep (a round that finished the request gets no feedback)
        valid = self.cache.length(slot) if round_start is None else min(round_start[0], self.cache.length(slot))
        if self._keeps and seq.finish_reason != "error" and valid <= seq.num_tokens:
            self.kept[slot] = seq.token_ids[:valid]
        else:
            self.kept[slot] = []
            self.cache.reset(slot)

    CALIBRATION_READS = (32, 64, 128, 256)  # prompt lengths timed by :meth:`calibrate`
    CALIBRATION_RESUMES = (8, 16, 32, DECODE_CHUNK)  # catch-ups on generated tokens timed by it

    def calibrate(self, slot: int, token: int, reference: Callable[[], object]) -> DraftCalibration:
        """Warm timings for a cost model, each in runs of ``reference`` (the target's decode
        step) timed just before it (:func:`~verispec.speculative.cost_model.relative_time`): (a draft
        step, [(prompt length, time to read it)], [(generated tokens, time to catch up on
        them)]). A prompt is read in one pass, generated tokens in the decode-sized passes of
        :meth:`catch_up`. Leaves ``slot`` empty."""
        room = self.cache.max_len - 4  # a read, then the step's four single-token passes

        def read(length: int) -> None:
            self.cache.reset(slot)
            self._next_logits(slot, [token] * length, prefill=True)

        reads = [(n, relative_time(lambda: read(n), reference))
                 for n in [n for n in self.CALIBRATION_READS if n <= room] or [max(room, 1)]]
        step = relative_time(lambda: self._next_logits(slot, [token]), reference)  # after the last read
        context = min(self.CALIBRATION_READS[0], room // 2)
        read(context)

        def resume(length: int) -> None:
            self._next_logits(slot, [token] * length)
            self.cache.truncate(slot, context)

        resumes = [(n, relative_time(lambda: resume(n), reference))
                   for n in self.CALIBRATION_RESUMES if context + n <= room]
        self.cache.reset(slot)
        return DraftCalibration(step, reads, resumes)

    def _forward(self, slot: int, tokens: list[int], prefill: bool = False) -> torch.Tensor:
        """Feed ``tokens``; return the next-token logits over the target's vocabulary [V_target]."""
        return self._align_vocab(self._next_logits(slot, tokens, prefill))

    def _next_logits(self, slot: int, tokens: list[int], prefill: bool = False) -> torch.Tensor:
        """Feed ``tokens``; return the next-token logits as the draft's head computes them:
        [V_draft], or [V_kept] with a cut vocabulary (see :meth:`_align_vocab`)."""
        start = self.cache.length(slot)
        device = self.model.device
        ids = torch.tensor([tokens], device=device)  # [1, T]
        positions = torch.arange(start, start + len(tokens), device=device)[None]  # [1, T]
        return self.model(ids, positions, self.cache, slots=[slot], num_logits=1, prefill=prefill,
                          head=self.vocab)[0, -1]

    def _argmax(self, logits: torch.Tensor) -> int:
        """The greedy draft token of :meth:`_next_logits`' logits. With a cut vocabulary, the
        argmax of the kept logits, without spreading them over the whole vocabulary first (the
        -inf fill and copies right after the kernels' call cost a draft step a noticeable part of
        its time: docs/benchmarks/per-token-costs.md)."""
        if self.vocab is not None:
            return self.vocab.token(int(logits.argmax()))
        return int(self._align_vocab(logits).argmax())

    def _argmax_prob(self, logits: torch.Tensor) -> tuple[int, float]:
        """:meth:`_argmax`'s token and its softmax probability over the logits the head scored.
        Computed in NumPy, on one thread: a torch reduction over the vocabulary right after the
        kernels' call would wait for the core their pool's worker spins on, which costs several times the
        NumPy computation (docs/benchmarks/per-token-costs.md)."""
        row = logits.detach().float().cpu().numpy()
        index = int(row.argmax())
        total = float(np.exp(row - row[index]).sum())  # >= 1: the argmax's own term
        token = self.vocab.token(index) if self.vocab is not None else index
        if token >= self.target_vocab:  # a draft-only id (a padded table): as _argmax does
            return self._argmax(logits), 0.0
        return token, 1.0 / total

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] (or the kept ids of a cut vocabulary) -> [..., V_target].

        Embedding tables are often padded past the tokenizer; align with the target's size.
        Draft-only ids get -inf, so q (and hence what is sampled) never includes them.
        """
        if self.vocab is not None:
            return self.vocab.expand(logits)
        if logits.shape[-1] >= self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - logits.shape[-1]), float("-inf"))
        return torch.cat((logits, pad), dim=-1)
