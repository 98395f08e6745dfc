"""The generation loop: prefill, then rounds of propose → verify → accept → commit.

The engine runs a batch of sequences, each in its own slot of one preallocated KV cache
(``max_num_seqs`` slots, never reallocated). A request joins with :meth:`Engine.add_request`
(which prefills it; :meth:`Engine.add_requests` prefills n samples of one prompt once and copies
the K/V; :meth:`Engine.begin_requests` and :meth:`Engine.prefill` do it a chunk at a time, which
gives the same sequences bit for bit where prompts run on the decode kernels,
:attr:`Engine.chunked_prefill`), every :meth:`Engine.step` advances all running sequences by one round, and a finished
(or aborted) sequence frees its slot for the next request. :meth:`Engine.generate` is the
batch-of-one case.

The engine works on token ids; text appears only where stop strings need it (through the
sequence's detokenizer). Plain decoding is the same loop with no drafter: every round proposes
nothing and the target's single-position pass yields exactly one token, so plain and speculative
decoding share one code path, and greedy speculative output is token-identical to plain greedy
output as long as the decoder is batch invariant (see :mod:`verispec.models.decoder`).

One round for a sequence whose target cache holds ``L`` positions (every committed token but
the last, ``t``)::

    propose  controller -> k; drafter -> d_1..d_n      (n <= k)
    verify   target([t, d_1..d_n] at positions L..L+n) -> p_1..p_{n+1}; verification keeps
             a <= n drafts and adds one recovered-or-bonus token x
    accept   commit d_1..d_a, x, stopping early on EOS / stop string / max_tokens
    commit   roll the target cache back to L + 1 + a; tell the drafter and the controller

Chains of every sequence in the batch are verified in ONE target forward: rows are padded to the
longest, ``T = 1 + max n``. Row b writes its T tokens at its own cache indices ``L_b .. L_b + T``
and its positions are ``L_b + [0, T)``, so the decoder's causal mask (key index <= query index,
per row) is exactly the mask each row needs: a real token never sees the padding after it, and a
row never sees another row's slot. Padding K/V is discarded by the commit's rollback. Each row is
verified on its own with its own generator, so a sequence's output does not depend on its
neighbours as long as the decoder rows are batch invariant. The cache keeps ``k`` positions of
headroom past ``max_model_len`` so padding always fits.

A tree proposal (``proposal.parents`` set) and a chain that carries an aux branch (lookahead)
need their own attention mask, so each gets its own forward in the same step: the root t and the
n tree nodes go to cache indices L..L+n with a tree attention mask and RoPE positions L + depth;
verification walks the tree, and commit keeps the accepted path's K/V with one compaction
(:meth:`KVCache.keep`).

k per sequence: the batch-aware rule of :mod:`verispec.engine.batch_k` caps it as the batch
grows, and the controller (:mod:`verispec.speculative.controller`) picks a k up to that cap from
measured costs and the request's acceptance; for a tree whose nodes carry draft values it also
picks how many of the best nodes to verify (the node budget), and a draft model's chain stops
within k where the controller's ``keep_drafting`` says its next draft would not pay. A request
that sets its own ``num_speculative_tokens`` pins k (at most the engine's): it skips all three
and drafts that many every round it can, as asked. So does a seeded sampled request, at the
engine's k, so that its seed reproduces its output (its random draws depend on how many drafts
each round verifies; greedy output does not depend on k at all).

Hidden states. A drafter that declares ``hidden_layers`` (Medusa heads, EAGLE) gets the target's
hidden states of those layers from the passes the engine runs anyway: after prefill, every prompt
position; after each round, the rows of the committed tokens' inputs (a tree's accepted path), in
``seq.target_hidden``, set before ``feedback``. No pass is added for them.

Logprobs. A request that asks for them (``SamplingParams.logprobs``) gets, for each committed
token, the log-softmax of the target row that emitted it (:mod:`verispec.logprobs`): the prefill's
last row, a plain step's row, or the verify pass's row of an accepted draft, the recovered token or
the bonus token (a tree's: its root and accepted path, :meth:`Verified.rows`). They are computed
after the stop check, for the committed tokens only, and for no other request.

Grammars. A request with ``SamplingParams.grammar`` (structured outputs) gets a matcher at
prefill; :mod:`verispec.constraints` cuts its drafts at the first one the grammar forbids, masks
the target's logits of every verified position with the grammar's state after the drafts before
it, and advances by the committed tokens only. Logprobs are taken from the unmasked logits.

Penalties, ``logit_bias`` and ``min_tokens`` change the target's logits of every verified row
before it is verified or sampled, each row counting the tokens before it, the round's earlier
drafts included (:func:`verispec.penalties.penalize`); logprobs read the raw rows.

Slots and prefix caching are in :mod:`verispec.engine.slots`, the cost calibration of an
adaptive engine in :mod:`verispec.engine.calibration`, and what happens when something fails (one
sequence fails, never the batch) in :mod:`verispec.engine.faults`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec import constraints
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.detokenize import IncrementalDetokenizer
from verispec.engine import faults
from verispec.engine.batch_k import StepCosts, choose_k
from verispec.engine.calibration import calibrate
from verispec.engine.slots import SlotTable, prefix_caching_for
from verispec.logprobs import token_logprobs
from verispec.penalties import penalize
from verispec.sequence import Sequence
from verispec.sampling import logits_to_probs, make_generator
from verispec.speculative.base import EMPTY_PROPOSAL, Drafter, DrafterContext, Outcome, Proposal
from verispec.speculative.controller import AdaptiveController, Controller, RoundReport, build_controller
from verispec.metrics import SpecMetrics
from verispec.speculative.registry import build_drafter
from verispec.speculative.tree import Tree, tree_layout
from verispec.speculative.tree_verify import verify_tree_greedy, verify_tree_stochastic
from verispec.speculative.verify import VerifyResult, verify_greedy, verify_stochastic

if TYPE_CHECKING:
    from verispec.models.loader import LoadedModel

@dataclass(frozen=True)
class Verified:
    result: VerifyResult
    cache_start: int  # target cache length before the verify pass (L)
    path: tuple[int, ...] | None = None  # tree proposals: accepted nodes (root = node 0 excluded)
    aux_logits: torch.Tensor | None = None  # [m, V] logits of the proposal's aux branch
    proposal: Proposal | None = None  # what was verified, when not the drafter's proposal (a retry)
    features: torch.Tensor | None = None  # [n+1, F] the pass's rows (tree: its nodes), for the drafter
    logits: torch.Tensor | None = None  # [n+1, V] the pass's target logits (tree: its nodes), for logprobs

    def rows(self, num_committed: int) -> list[int]:
        """The pass's rows (tree nodes) whose logits gave the committed tokens, in order: the
        committed tokens' inputs. A chain's are its first rows; a tree's are its root and the
        accepted path, e.g. path (2, 5) commits 3 tokens from nodes [0, 2, 5]."""
        if self.path is None:
            return list(range(num_committed))
        return [0, *self.path][:num_committed]


class Engine:
    """Batched generation with an optional drafter.

    Args:
        target: the loaded target model.
        speculative: which drafter to use; ``None`` for plain decoding.
        max_model_len: prompt + output positions one sequence may hold.
        drafter: an already built drafter, instead of building one from ``speculative``
            (which then only supplies ``num_speculative_tokens`` and ``adaptive``).
        max_num_seqs: sequences that can run at once (cache slots).
        controller: chooses k each round (at most ``num_speculative_tokens``); by default the
            one ``speculative.adaptive`` asks for.
        prefix_caching: reuse the K/V a free slot kept from an earlier request (see the module
            doc); ``None`` turns it on where it is exact and free, ``True`` wherever it is exact
            (a ``ValueError`` elsewhere).
    """

    def __init__(
        self,
        target: LoadedModel,
        speculative: SpeculativeConfig | None = None,
        *,
        max_model_len: int = 4096,
        drafter: Drafter | None = None,
        max_num_seqs: int = 1,
        controller: Controller | None = None,
        prefix_caching: bool | None = None,
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
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"a drafter subclasses verispec.speculative.base.Drafter; got {type(drafter).__name__}")
        self.drafter = drafter
        # Target hidden-state layers the drafter reads (Medusa, EAGLE), in the decoder's
        # numbering: 0 = embeddings, i = after layer i, -1 = the final normed state.
        self.hidden_layers = None if drafter is None else drafter.hidden_layers
        # whether prefill must hand over every prompt position's states (EAGLE) or the last (Medusa)
        self.needs_every_prompt_state = self.hidden_layers is not None and not drafter.last_prompt_state_only
        self.controller = controller or build_controller(speculative)
        adaptive = isinstance(self.controller, AdaptiveController)
        if adaptive and drafter is not None:
            drafter.bind_costs(self.controller.costs)  # lookahead prices its window with them
            if drafter.stops_within_round:
                drafter.bind_stop(self._keep_drafting)  # a draft model stops where its drafts stop paying
                self.controller.value_stops = True
        self.prefix_caching = prefix_caching_for(self.model, prefix_caching, self.needs_every_prompt_state)
        self.slots = SlotTable(self.cache, max_num_seqs, self.prefix_caching)
        if drafter is not None:  # a draft model reads prompts as the target prefills them
            drafter.reads_prompts_as(prefill=not self.prefix_caching)
        self.running: list[Sequence] = []
        self.costs = StepCosts()  # measured costs that batch-aware k is chosen from
        self.metrics = SpecMetrics()  # aggregated over finished requests
        if controller is None and adaptive and self.k > 0:
            # (a controller passed in comes with its own costs)
            calibrate(self.model, self.cache, self.slots.free[-1], self.k, self.max_model_len, drafter,
                      self.controller.costs)

    @property
    def free_slots(self) -> list[int]:
        """The cache slots no running sequence holds."""
        return self.slots.free

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
        if seq.finish_reason == "error":
            raise RuntimeError(seq.error)
        return seq

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, num_speculative_tokens: int | None = None
    ) -> Sequence:
        """Prefill a new sequence into a free slot; it runs from the next :meth:`step` on.

        ``num_speculative_tokens`` pins this request's drafts per round (at most the engine's k;
        0 disables speculation for it); ``None`` lets the engine choose (batch-aware k). Raises
        ``RuntimeError`` when every slot is taken.
        """
        return self.add_requests(prompt_ids, [params], num_speculative_tokens)[0]

    def add_requests(
        self, prompt_ids: list[int], params: list[SamplingParams], num_speculative_tokens: int | None = None
    ) -> list[Sequence]:
        """``len(params)`` samples of one prompt (a request's ``n``), one sequence each, sharing
        one prefill: the prompt's K/V is copied into the other samples' slots, and every sample
        draws its first token from the prefill's last row with its own generator (so each is the
        sequence :meth:`add_request` would give with its params). Raises ``RuntimeError`` when
        fewer slots are free, ``ValueError`` when the engine has fewer."""
        pending = self.begin_requests(prompt_ids, params, num_speculative_tokens)
        try:
            self.prefill(pending)
        except BaseException:
            self.abort_prefill(pending)
            raise
        return pending.seqs

    def begin_requests(
        self, prompt_ids: list[int], params: list[SamplingParams], num_speculative_tokens: int | None = None
    ) -> Prefill:
        """:meth:`add_requests` in steps: take the slots and set up the sequences, with nothing
        run yet. :meth:`prefill` then runs the prompt (whole, or a chunk at a time where
        :attr:`chunked_prefill`); the sequences join the batch with its last chunk.
        :meth:`abort_prefill` gives the slots back."""
        if len(params) > self.cache.num_slots:
            raise ValueError(f"n={len(params)} samples need as many sequence slots; the engine has "
                             f"{self.cache.num_slots} (max_num_seqs)")
        if len(self.free_slots) < len(params):
            raise RuntimeError(f"{len(params)} free sequence slots are needed, but "
                               f"{self.cache.num_slots - len(self.free_slots)} of {self.cache.num_slots} slots are in use")
        slot = self.slots.choose(prompt_ids)
        forks = [s for s in reversed(self.free_slots) if s != slot][: len(params) - 1]
        pending = self._start(prompt_ids, params, [slot, *forks], num_speculative_tokens)
        for seq in pending.seqs:
            self.slots.take(seq.slot)
        return pending

    @property
    def chunked_prefill(self) -> bool:
        """Whether a prompt may be prefilled a chunk at a time: where prompts run through the
        decode kernels (with prefix caching), whose rows do not depend on what else a pass holds,
        so the chunks' K/V and last logits are the whole prompt's, bit for bit."""
        return self.prefix_caching

    def prefill(self, pending: Prefill, max_tokens: int | None = None) -> bool:
        """Run the next ``max_tokens`` positions of ``pending``'s prompt (None, or without
        :attr:`chunked_prefill`: all that are left). With the last, its sequences get their first
        tokens and join the batch (a sequence that ends there leaves it at once). Returns whether
        the prefill is done."""
        left = len(pending.prompt_ids) - pending.done
        n = left if max_tokens is None or not self.chunked_prefill else max(min(max_tokens, left), 1)
        last = n == left
        seq = pending.seqs[0]
        t0 = time.perf_counter()
        device = self.model.device
        ids = torch.tensor([pending.prompt_ids[pending.done:pending.done + n]], device=device)  # [1, n]
        positions = torch.arange(pending.done, pending.done + n, device=device)[None]
        # with prefix caching, the decode path: its entries are the ones a later request reuses
        logits, features = self._run(ids, positions, [seq.slot], num_logits=1 if last else 0,
                                     prefill=not self.prefix_caching)  # [1, 1 or 0, V]
        pending.done += n
        if features is not None:
            pending.features.append(features[0])  # [n, F]
        seq.metrics.prefill_time_s += time.perf_counter() - t0
        if last:
            self._finish_prefill(pending, logits)
        return last

    def abort_prefill(self, pending: Prefill) -> None:
        """Give back the slots of a prefill that will not finish (its client went away, or it
        failed); a sequence that already joined the batch is aborted."""
        for seq in pending.seqs:
            if seq in self.running:
                self.abort(seq)
            elif seq.slot not in self.slots.free:
                seq.finish_reason = seq.finish_reason or "abort"
                self.slots.release(seq.slot, [], reusable=False)

    def abort(self, seq: Sequence) -> None:
        """Stop a running sequence now and free its slot (a client went away)."""
        if seq in self.running:
            seq.finish_reason = "abort"
            self._release(seq)

    def step(self) -> dict[Sequence, str]:
        """One round for every running sequence: propose → verify → accept → commit.

        Returns the new text of each sequence that took part. Sequences that finish leave the
        batch and free their slot; so do sequences that failed (``finish_reason == "error"``,
        see :mod:`verispec.engine.faults`).
        """
        for seq in self.running:
            if self.cache.length(seq.slot) + 1 > self.max_model_len:
                seq.finish_reason = "length"  # the context is full, as in vLLM
        batch = [seq for seq in self.running if not seq.finished]
        texts: dict[Sequence, str] = {}
        if batch:
            k = choose_k(self.k, len(batch), self.costs)
            proposals, draft_s = [], []
            for seq in batch:
                t0 = time.perf_counter()
                try:
                    proposals.append(self._propose(seq, self._k_for(seq, k)))
                except Exception as e:
                    faults.fail(seq, "drafting", e)
                    proposals.append(EMPTY_PROPOSAL)
                draft_s.append(time.perf_counter() - t0)
                seq.metrics.draft_time_s += draft_s[-1]
            live = [i for i, seq in enumerate(batch) if not seq.finished]
            batch, proposals, draft_s = [batch[i] for i in live], [proposals[i] for i in live], [draft_s[i] for i in live]
            verified, verify_s = self._verify(batch, proposals)
            for seq, proposal, v, ds, vs in zip(batch, proposals, verified, draft_s, verify_s):
                if v is None:
                    continue  # failed in verification
                try:
                    t0 = time.perf_counter()
                    if v.proposal is not None:
                        proposal = v.proposal  # a retry verified no drafts
                    outcome, texts[seq] = self._accept(seq, proposal, v)
                    self._commit(seq, v, outcome)
                    seq.metrics.other_time_s += time.perf_counter() - t0
                    aux = 0 if outcome.aux_logits is None else outcome.aux_logits.shape[0]
                    report = RoundReport(outcome.num_proposed, outcome.num_accepted, len(outcome.committed), ds, vs,
                                         num_positions=1 + outcome.num_proposed + aux,
                                         depth=proposal.depth() if proposal.parents is not None else 0)
                    self.controller.observe(seq, report)
                except Exception as e:
                    faults.fail(seq, "committing its tokens", e)
        for seq in [s for s in self.running if s.finished]:
            self._release(seq)
        return texts

    # ---- phases ------------------------------------------------------------------------------

    def _start(
        self, prompt_ids: list[int], params: list[SamplingParams], slots: list[int],
        num_speculative_tokens: int | None
    ) -> Prefill:
        """The sequences of ``prompt_ids`` (one per params, in ``slots``), before any of the prompt
        has run; ``slots[0]`` keeps what its cache shares with the prompt."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}"
            )
        tok = self.target.tokenizer
        seqs = [Sequence(
            prompt_ids=list(prompt_ids),
            params=p,
            generator=make_generator(p.seed, self.model.device),
            eos_token_ids=tok.eos_token_ids,
            detokenizer=IncrementalDetokenizer(tok, prompt_ids),
            slot=slot,
            num_speculative_tokens=num_speculative_tokens,
            constraint=constraints.start(p.grammar, tok, self.model.config.vocab_size),
        ) for p, slot in zip(params, slots)]
        # positions kept from an earlier request; the prompt's last token is always run, for its logits
        kept = self.slots.reuse(seqs[0].slot, prompt_ids)
        seqs[0].metrics.cached_prompt_tokens = kept
        return Prefill(seqs, list(prompt_ids), kept)

    def _finish_prefill(self, pending: Prefill, logits: torch.Tensor) -> None:
        """The prompt has run: copy its K/V into the other samples' slots; each sequence takes its
        first token from the last row and joins the batch."""
        first = pending.seqs[0]
        features = torch.cat(pending.features) if pending.features else None  # [P - kept, F]
        for fork in pending.seqs[1:]:
            self.slots.copy(first.slot, fork.slot)
        for seq in pending.seqs:
            t0 = time.perf_counter()
            if features is not None:
                seq.target_hidden = features
            result = self._verify_logits(seq, EMPTY_PROPOSAL, logits)
            committed, _ = seq.append(result.committed(0))
            constraints.commit(seq, committed)
            _record_logprobs(seq, logits[0], [0], committed)
            if self.drafter is not None and not seq.finished:
                self.drafter.start(seq)  # per-request set-up (a draft model defers reading the prompt)
            seq.metrics.prefill_time_s += time.perf_counter() - t0
            self.running.append(seq)
        for seq in pending.seqs:
            if seq.finished:
                self._release(seq)

    def _propose(self, seq: Sequence, k_max: int) -> Proposal:
        # Never draft past max_tokens or past the cache: the verify pass writes n + 1 positions.
        room = min(
            k_max,
            seq.params.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - self.cache.length(seq.slot) - 1,
        )
        if self.drafter is None or room <= 0:
            return EMPTY_PROPOSAL
        k = room if _fixed_k(seq) else self.controller.choose_k(seq, room)
        if not 0 <= k <= room:
            raise RuntimeError(f"the controller chose k={k}, outside 0..{room}")
        if k == 0:
            return EMPTY_PROPOSAL
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seq, k)
        self.costs.record_proposal(len(proposal), time.perf_counter() - t0)
        proposal = constraints.cut(seq, proposal)
        if proposal.depth() > k:
            raise RuntimeError(f"drafter proposed a depth of {proposal.depth()}, more than the {k} asked for")
        if proposal.values is not None and len(proposal) > 1 and not _fixed_k(seq):
            # The node budget: how many of the tree's best nodes are worth a verify position.
            n = self.controller.choose_nodes(seq, proposal.values, time.perf_counter() - t0)
            if not 1 <= n <= len(proposal):
                raise RuntimeError(f"the controller kept {n} tree nodes, outside 1..{len(proposal)}")
            proposal = proposal.first_nodes(n)
        return proposal

    def _keep_drafting(self, seq: Sequence, drafted: int, value: float) -> bool:
        """The drafter's stop within a round (the controller's rule), except for a request that
        drafts a fixed k (pinned, or seeded and sampled: see the module doc)."""
        return _fixed_k(seq) or self.controller.keep_drafting(seq, drafted, value)

    def _k_for(self, seq: Sequence, batch_k: int) -> int:
        """The most drafts this sequence may propose: its request's own k if it set one, else
        the k chosen for the batch (a seeded sampled request keeps the full k, see the module
        doc)."""
        if seq.num_speculative_tokens is not None:
            return min(seq.num_speculative_tokens, self.k)
        if _fixed_k(seq):
            return self.k
        return batch_k

    def _verify(self, batch: list[Sequence], proposals: list[Proposal]
                ) -> tuple[list[Verified | None], list[float]]:
        """Verify every proposal: chains in ONE target forward (rows padded to T), trees and
        aux-carrying chains in a forward each. Returns the results (None for a sequence that
        failed) and each one's verify time. A failed forward is retried without speculation
        (see :mod:`verispec.engine.faults`)."""
        chains = [i for i, p in enumerate(proposals) if p.parents is None and p.aux is None]
        verified: list[Verified | None] = [None] * len(batch)
        seconds = [0.0] * len(batch)
        if chains:
            t0 = time.perf_counter()
            results = faults.verify_retrying(self.cache, [batch[i] for i in chains], [proposals[i] for i in chains],
                                             self._verify_pass)
            elapsed = time.perf_counter() - t0
            for i, v in zip(chains, results):
                verified[i], seconds[i] = v, elapsed
        for i, (seq, proposal) in enumerate(zip(batch, proposals)):
            if i in chains:
                continue
            t0 = time.perf_counter()
            single = self._verify_tree if proposal.parents is not None else self._verify_aux
            verified[i] = faults.verify_alone_retrying(self.cache, seq, proposal, single, self._verify_pass)
            seconds[i] = time.perf_counter() - t0
        for i, (seq, s) in enumerate(zip(batch, seconds)):
            seq.metrics.verify_time_s += s / len(chains) if i in chains else s  # a shared pass is split
        return verified, seconds

    def _verify_pass(self, batch: list[Sequence], proposals: list[Proposal], starts: list[int]
                     ) -> list[Verified | None]:
        """ONE target forward over every sequence's last token and drafts, rows padded to T,
        then each row verified on its own (a row that fails there is failed alone)."""
        return self._verify_rows(batch, proposals, starts, self._forward_chains(batch, proposals, starts))

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], **kwargs
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A target pass: its logits, and the features the drafter reads ([B, T, F], or None)."""
        if self.hidden_layers is None:
            return self.model(ids, positions, self.cache, slots=slots, **kwargs), None
        out = self.model(ids, positions, self.cache, slots=slots, output_hidden_states=True, **kwargs)
        layers = [out.hidden_states[i] for i in self.hidden_layers]
        return out.logits, layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1)

    def _forward_chains(self, batch: list[Sequence], proposals: list[Proposal], starts: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        width = 1 + max(len(p) for p in proposals)  # T
        # Padding repeats the row's last token; the causal mask hides it from the real tokens.
        rows = [[seq.output_ids[-1], *p.tokens] + [seq.output_ids[-1]] * (width - 1 - len(p))
                for seq, p in zip(batch, proposals)]
        device = self.model.device
        ids = torch.tensor(rows, device=device)  # [B, T]
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # [B, T]
        t0 = time.perf_counter()
        logits, features = self._run(ids, positions, [seq.slot for seq in batch])  # [B, T, V], [B, T, F]
        elapsed = time.perf_counter() - t0
        self.costs.record_forward(len(batch) * width, elapsed)
        if len(batch) == 1:
            batch[0].metrics.record_target(width, elapsed)  # single-sequence cost model (c, alpha)
        return logits, features

    def _verify_rows(self, batch: list[Sequence], proposals: list[Proposal], starts: list[int],
                     forward: tuple[torch.Tensor, torch.Tensor | None]) -> list[Verified | None]:
        logits, features = forward
        verified: list[Verified | None] = []
        for b, (seq, proposal) in enumerate(zip(batch, proposals)):
            row_logits = logits[b : b + 1, : len(proposal) + 1]  # [1, n+1, V]
            row_features = None if features is None else features[b, : len(proposal) + 1]  # [n+1, F]
            try:
                verified.append(Verified(self._verify_logits(seq, proposal, row_logits), starts[b],
                                         features=row_features, logits=row_logits[0]))
            except Exception as e:
                faults.fail(seq, "verifying and sampling", e)
                verified.append(None)
        return verified

    def _verify_aux(self, seq: Sequence, proposal: Proposal) -> Verified:
        """A chain plus the drafter's aux branch (lookahead) in one forward with its own mask."""
        start = self.cache.length(seq.slot)
        segment = [seq.output_ids[-1], *proposal.tokens]  # t, d_1..d_n
        aux = proposal.aux
        if start + len(segment) + len(aux.tokens) > self.max_model_len:
            aux = None  # the branch only helps drafting: skip it when the cache is nearly full
        tokens, offsets = segment, list(range(len(segment)))
        mask = None
        if aux is not None:
            tokens, offsets = segment + aux.tokens, offsets + aux.positions
            if self.model.config.sliding_window is not None:
                raise ValueError("aux branches (lookahead) do not support sliding-window attention")
            mask = aux.attention_mask(start, len(segment), self.model.device)[None]
        device = self.model.device
        ids = torch.tensor([tokens], device=device)  # [1, n+1+m]
        positions = start + torch.tensor([offsets], device=device)  # [1, n+1+m]
        t0 = time.perf_counter()
        logits, features = self._run(ids, positions, [seq.slot], attn_mask=mask)  # [1, n+1+m, V]
        seq.metrics.record_target(ids.shape[1], time.perf_counter() - t0)
        n1 = len(segment)
        aux_logits = None if aux is None else logits[0, n1:]  # [m, V]
        return Verified(self._verify_logits(seq, proposal, logits[:, :n1]), start, aux_logits=aux_logits,
                        features=None if features is None else features[0, :n1], logits=logits[0, :n1])

    def _verify_logits(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        p = seq.params
        draft = torch.tensor([proposal.tokens], dtype=torch.long, device=logits.device)  # [1, n]
        logits = penalize(seq, proposal.tokens, logits)  # [1, n+1, V] (see verispec.penalties)
        logits = constraints.mask_chain(seq, proposal.tokens, logits)  # [1, n+1, V]
        if p.greedy:
            return verify_greedy(draft, logits)
        target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [1, n+1, V]
        draft_probs = None if proposal.probs is None else proposal.probs[None]  # [1, n, V]
        return verify_stochastic(draft, draft_probs, target_probs, seq.generator)

    def _verify_tree(self, seq: Sequence, proposal: Proposal) -> Verified:
        start = self.cache.length(seq.slot)
        proposal = proposal.first_nodes(self.max_model_len - start - 1)
        tree = Tree((-1, *proposal.parents))
        layout = tree_layout(tree, start, self.model.device)
        ids = torch.tensor([[seq.output_ids[-1], *proposal.tokens]], device=self.model.device)  # [1, N]
        t0 = time.perf_counter()
        logits, features = self._run(ids, layout.positions[None], [seq.slot], attn_mask=layout.mask[None])
        logits = logits[0]  # [N, V]
        seq.metrics.record_target(len(tree), time.perf_counter() - t0)
        p = seq.params
        scores = penalize(seq, proposal.tokens, logits, proposal.parents)  # [N, V]; logprobs read the raw logits
        masked = constraints.mask_tree(seq, proposal.parents, proposal.tokens, scores)  # [N, V]
        if p.greedy:
            result = verify_tree_greedy(tree, proposal.tokens, masked)
        else:
            target_probs = logits_to_probs(masked, p.temperature, p.top_k, p.top_p, p.min_p)  # [N, V]
            result = verify_tree_stochastic(tree, proposal.tokens, proposal.probs, target_probs,
                                            proposal.children, seq.generator)
        seq.metrics.record_tree(len(proposal), result.num_accepted)
        as_chain = VerifyResult(torch.tensor([result.num_accepted]), torch.tensor([result.tokens]))
        return Verified(as_chain, start, result.path, features=None if features is None else features[0],
                        logits=logits)

    def _accept(self, seq: Sequence, proposal: Proposal, verified: Verified) -> tuple[Outcome, str]:
        committed, text = seq.append(verified.result.committed(0))
        constraints.commit(seq, committed)
        _record_logprobs(seq, verified.logits, verified.rows(len(committed)), committed)
        outcome = Outcome(len(proposal), int(verified.result.num_accepted[0]), committed, verified.aux_logits)
        seq.metrics.record_round(outcome.num_proposed, outcome.num_accepted, len(committed))
        return outcome, text

    def _commit(self, seq: Sequence, verified: Verified, outcome: Outcome) -> None:
        # The pass wrote t, d_1..d_n; keep t and the accepted drafts (the last committed token's
        # K/V is written next round). A tree keeps its root and accepted path, compacted.
        keep = verified.rows(len(outcome.committed))
        if verified.path is None:
            self.cache.truncate(seq.slot, verified.cache_start + len(outcome.committed))
        else:
            self.cache.keep(seq.slot, verified.cache_start, keep)
        if verified.features is not None:
            seq.target_hidden = verified.features[keep]  # [len(committed), F]
        self.costs.record_acceptance(outcome.num_accepted)
        if self.drafter is not None and not seq.finished:
            self.drafter.feedback(seq, outcome)


    def _release(self, seq: Sequence) -> None:
        """A finished sequence leaves the batch: drop drafter state, free its slot."""
        self.running.remove(seq)
        if self.drafter is not None:
            try:
                self.drafter.finish(seq)
            except Exception:  # the slot is freed whatever the drafter does
                faults.log.exception("the drafter failed to drop the state of slot %d", seq.slot)
        self.slots.release(seq.slot, seq.token_ids, reusable=seq.finish_reason != "error")
        self.metrics.merge(seq.metrics)


@dataclass(eq=False)
class Prefill:
    """A prompt on its way into the cache: its sequences (a request's n samples) hold their slots,
    and the first ``done`` positions of the prompt are in the first one's cache."""

    seqs: list[Sequence]
    prompt_ids: list[int]
    done: int
    features: list[torch.Tensor] = field(default_factory=list)  # [n, F] per chunk, for a drafter

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.done


def _record_logprobs(seq: Sequence, logits: torch.Tensor, rows: list[int], committed: list[int]) -> None:
    """Append the committed tokens' logprobs, for a request that asks for them (nothing is
    computed otherwise): ``logits[rows[i]]`` (``logits`` is a pass's ``[rows, V]``) is the
    target row that gave ``committed[i]`` (see :mod:`verispec.logprobs`)."""
    if seq.params.logprobs is not None:
        seq.output_logprobs.extend(token_logprobs(logits[rows], committed, seq.params.logprobs))


def _fixed_k(seq: Sequence) -> bool:
    """A request that pinned its k, or a seeded sampled one (its seed must reproduce its output),
    drafts a fixed k."""
    return seq.num_speculative_tokens is not None or (seq.params.seed is not None and not seq.params.greedy)
