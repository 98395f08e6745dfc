"""The generation loop: prefill, then rounds of propose → verify → accept → commit.

The engine runs a batch of sequences, each in its own slot of one preallocated KV cache
(``max_num_seqs`` slots, never reallocated). A request joins with :meth:`Engine.add_request`
(which prefills it), every :meth:`Engine.step` advances all running sequences by one round with
ONE target forward, and a finished (or aborted) sequence frees its slot for the next request.
:meth:`Engine.generate` is the batch-of-one case.

The engine works on token ids; text appears only where stop strings need it (through the
sequence's detokenizer). Plain decoding is the same loop with no drafter: every round proposes
nothing and the target's single-position pass yields exactly one token, so plain and speculative
decoding share one code path, and greedy speculative output is token-identical to plain greedy
output as long as the decoder is batch invariant (see :mod:`verispec.models.decoder`).

One round for a sequence whose target cache holds ``L`` positions (every committed token but
the last, ``t``)::

    propose  drafter -> d_1..d_n                       (n <= k)
    verify   target([t, d_1..d_n] at positions L..L+n) -> p_1..p_{n+1}; verification keeps
             a <= n drafts and adds one recovered-or-bonus token x
    accept   commit d_1..d_a, x, stopping early on EOS / stop string / max_tokens
    commit   roll the target cache back to L + 1 + a; tell the drafter the outcome

In a batch every sequence proposes its own drafts (a different number, or none); the verify
pass pads every row to the longest, ``T = 1 + max n``. Row b writes its T tokens at its own
cache indices ``L_b .. L_b + T`` and its positions are ``L_b + [0, T)``, so the decoder's causal
mask (key index <= query index, per row) is exactly the mask each row needs: a real token never
sees the padding after it, and a row never sees another row's slot. Padding K/V is discarded by
the commit's rollback. Each row is verified on its own with its own generator, so a sequence's
output does not depend on its neighbours as long as the decoder rows are batch invariant (bf16
linear rows are bitwise invariant on CPU; attention reduces per row over block-padded lengths).
The cache keeps ``k`` positions of headroom past ``max_model_len`` so padding always fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.detokenize import IncrementalDetokenizer
from verispec.engine.batch_k import StepCosts, choose_k
from verispec.engine.sequence import Sequence
from verispec.sampling import logits_to_probs, make_generator
from verispec.spec.base import EMPTY_PROPOSAL, Drafter, DrafterContext, Outcome, Proposal, build_drafter
from verispec.spec.metrics import SpecMetrics
from verispec.spec.verify import VerifyResult, verify_greedy, verify_stochastic

if TYPE_CHECKING:
    from verispec.models.loader import LoadedModel


@dataclass(frozen=True)
class Verified:
    result: VerifyResult
    cache_start: int  # target cache length before the verify pass (L)


class Engine:
    """Batched generation with an optional drafter.

    Args:
        target: the loaded target model.
        speculative: which drafter to use; ``None`` for plain decoding.
        max_model_len: prompt + output positions one sequence may hold.
        drafter: an already built drafter, instead of building one from ``speculative``
            (which then only supplies ``num_speculative_tokens``).
        max_num_seqs: sequences that can run at once (cache slots).
    """

    def __init__(
        self,
        target: LoadedModel,
        speculative: SpeculativeConfig | None = None,
        *,
        max_model_len: int = 4096,
        drafter: Drafter | None = None,
        max_num_seqs: int = 1,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.target = target
        self.model = target.model
        self.max_model_len = min(max_model_len, self.model.config.max_position_embeddings)
        self.k = speculative.num_speculative_tokens if speculative else 0
        # k positions of headroom: a verify pass pads every row to the longest proposal.
        self.cache = self.model.new_cache(self.max_model_len + self.k, num_slots=max_num_seqs)
        if drafter is None and speculative is not None:
            drafter = build_drafter(speculative, DrafterContext(target, self.max_model_len, max_num_seqs))
        self.drafter = drafter
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.running: list[Sequence] = []
        self.costs = StepCosts()  # measured costs that batch-aware k is chosen from
        self.metrics = SpecMetrics()  # aggregated over finished requests

    # ---- public API --------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
    ) -> Sequence:
        """Generate a completion for ``prompt_ids``; ``on_text`` receives text as it streams."""
        seq = self.add_request(prompt_ids, params)
        emit = on_text or (lambda _text: None)
        emit(seq.text)
        while not seq.finished:
            emit(self.step().get(seq, ""))
        return seq

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, num_speculative_tokens: int | None = None
    ) -> Sequence:
        """Prefill a new sequence into a free slot; it runs from the next :meth:`step` on.

        ``num_speculative_tokens`` pins this request's drafts per round (at most the engine's k;
        0 disables speculation for it); ``None`` lets the engine choose (batch-aware k). Raises
        ``RuntimeError`` when every slot is taken.
        """
        if not self.free_slots:
            raise RuntimeError(f"all {self.cache.num_slots} sequence slots are in use")
        seq = self._prefill(prompt_ids, params, self.free_slots[-1], num_speculative_tokens)
        self.free_slots.pop()
        self.running.append(seq)
        if seq.finished:
            self._release(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a running sequence now and free its slot (a client went away)."""
        if seq in self.running:
            seq.finish_reason = "abort"
            self._release(seq)

    def step(self) -> dict[Sequence, str]:
        """One round for every running sequence: propose → verify → accept → commit.

        Returns the new text of each sequence that took part. Sequences that finish leave the
        batch and free their slot.
        """
        for seq in self.running:
            if self.cache.length(seq.slot) + 1 > self.max_model_len:
                seq.finish_reason = "length"  # the context is full, as in vLLM
        batch = [seq for seq in self.running if not seq.finished]
        texts: dict[Sequence, str] = {}
        if batch:
            k = choose_k(self.k, len(batch), self.costs)
            proposals = [self._propose(seq, self._k_for(seq, k)) for seq in batch]
            verified = self._verify(batch, proposals)
            t0 = time.perf_counter()
            for seq, proposal, v in zip(batch, proposals, verified):
                outcome, texts[seq] = self._accept(seq, proposal, v)
                self._commit(seq, v, outcome)
            share = (time.perf_counter() - t0) / len(batch)
            for seq in batch:
                seq.metrics.other_time_s += share
        for seq in [s for s in self.running if s.finished]:
            self._release(seq)
        return texts

    # ---- phases ------------------------------------------------------------------------------

    def _prefill(
        self, prompt_ids: list[int], params: SamplingParams, slot: int, num_speculative_tokens: int | None
    ) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}"
            )
        tok = self.target.tokenizer
        seq = Sequence(
            prompt_ids=list(prompt_ids),
            params=params,
            generator=make_generator(params.seed, self.model.device),
            eos_token_ids=tok.eos_token_ids,
            detokenizer=IncrementalDetokenizer(tok.hf, prompt_ids),
            slot=slot,
            num_speculative_tokens=num_speculative_tokens,
        )
        t0 = time.perf_counter()
        self.cache.reset(seq.slot)
        ids = torch.tensor([prompt_ids], device=self.model.device)  # [1, P]
        positions = torch.arange(len(prompt_ids), device=self.model.device)[None]  # [1, P]
        logits = self.model(ids, positions, self.cache, slots=[seq.slot], num_logits=1)  # [1, 1, V]
        result = self._verify_logits(seq, EMPTY_PROPOSAL, logits)
        seq.append(result.committed(0))
        if self.drafter is not None and not seq.finished:
            self.drafter.start(seq)  # the drafter reads the prompt too: part of prefill
        seq.metrics.prefill_time_s += time.perf_counter() - t0
        return seq

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        # Never draft past max_tokens or past the cache: the verify pass writes n + 1 positions.
        room = min(
            k,
            seq.params.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - self.cache.length(seq.slot) - 1,
        )
        if self.drafter is None or room <= 0:
            return EMPTY_PROPOSAL
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seq, room)
        elapsed = time.perf_counter() - t0
        seq.metrics.draft_time_s += elapsed
        self.costs.record_proposal(len(proposal), elapsed)
        if len(proposal) > room:
            raise RuntimeError(f"drafter proposed {len(proposal)} tokens, more than the {room} asked for")
        return proposal

    def _k_for(self, seq: Sequence, batch_k: int) -> int:
        """Drafts this sequence may propose: its request's own k if it set one, else the k
        chosen for the batch. A seeded sampled request keeps the full k: its random draws depend
        on how many drafts each round verifies, and a k that followed measured timings would
        make the seed irreproducible (greedy output does not depend on k at all)."""
        if seq.num_speculative_tokens is not None:
            return min(seq.num_speculative_tokens, self.k)
        if seq.params.seed is not None and not seq.params.greedy:
            return self.k
        return batch_k

    def _verify(self, batch: list[Sequence], proposals: list[Proposal]) -> list[Verified]:
        """ONE target forward over every sequence's last token and drafts, rows padded to T."""
        starts = [self.cache.length(seq.slot) for seq in batch]
        width = 1 + max(len(p) for p in proposals)  # T
        # Padding repeats the row's last token; the causal mask hides it from the real tokens.
        rows = [[seq.output_ids[-1], *p.tokens] + [seq.output_ids[-1]] * (width - 1 - len(p))
                for seq, p in zip(batch, proposals)]
        device = self.model.device
        ids = torch.tensor(rows, device=device)  # [B, T]
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # [B, T]
        t0 = time.perf_counter()
        logits = self.model(ids, positions, self.cache, slots=[seq.slot for seq in batch])  # [B, T, V]
        elapsed = time.perf_counter() - t0
        self.costs.record_forward(len(batch) * width, elapsed)
        verified = []
        for b, (seq, proposal) in enumerate(zip(batch, proposals)):
            seq.metrics.verify_time_s += elapsed / len(batch)
            if len(batch) == 1:
                seq.metrics.record_target(width, elapsed)  # single-sequence cost model (c, alpha)
            row_logits = logits[b : b + 1, : len(proposal) + 1]  # [1, n+1, V]
            verified.append(Verified(self._verify_logits(seq, proposal, row_logits), starts[b]))
        return verified

    def _verify_logits(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        p = seq.params
        draft = torch.tensor([proposal.tokens], dtype=torch.long, device=logits.device)  # [1, n]
        if p.greedy:
            return verify_greedy(draft, logits)
        target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [1, n+1, V]
        draft_probs = None if proposal.probs is None else proposal.probs[None]  # [1, n, V]
        return verify_stochastic(draft, draft_probs, target_probs, seq.generator)

    def _accept(self, seq: Sequence, proposal: Proposal, verified: Verified) -> tuple[Outcome, str]:
        committed, text = seq.append(verified.result.committed(0))
        outcome = Outcome(len(proposal), int(verified.result.num_accepted[0]), committed)
        seq.metrics.record_round(outcome.num_proposed, outcome.num_accepted, len(committed))
        return outcome, text

    def _commit(self, seq: Sequence, verified: Verified, outcome: Outcome) -> None:
        # The pass wrote t, d_1..d_n (and padding); keep t and the accepted drafts (the last
        # committed token's K/V is written next round).
        self.cache.truncate(seq.slot, verified.cache_start + len(outcome.committed))
        self.costs.record_acceptance(outcome.num_accepted)
        if self.drafter is not None and not seq.finished:
            self.drafter.feedback(seq, outcome)

    def _release(self, seq: Sequence) -> None:
        """A finished sequence leaves the batch: drop drafter state, free its slot."""
        self.running.remove(seq)
        if self.drafter is not None:
            self.drafter.finish(seq)
        self.cache.reset(seq.slot)
        self.free_slots.append(seq.slot)
        self.metrics.merge(seq.metrics)

