"""The generation loop: prefill, then rounds of propose → verify → accept → commit.

The engine runs a batch of sequences, each in its own slot of one preallocated KV cache
(``max_num_seqs`` slots, never reallocated). A request joins with :meth:`Engine.add_request`
(which prefills it), every :meth:`Engine.step` advances all running sequences by one round, and a
finished (or aborted) sequence frees its slot for the next request. :meth:`Engine.generate` is
the batch-of-one case.

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

Calibration. An adaptive controller decides from measured costs, and the first run of each
shape pays one-time set-up (kernel primitives, allocation), often half as much again as a warm
run; a controller that learned those first samples would price drafting out and, never drafting
again, never measure it anew. So an engine that builds an
:class:`~verispec.speculative.controller.AdaptiveController` (``"adaptive": true``) runs each
verify width 1..k+1 on a scratch slot when it is built (one cold run, then the median of three),
and the drafter's own calibration when it has one (``calibrate``, see
:mod:`verispec.speculative.base`), and seeds the cost model with the warm timings. Each time but
the decode step's own is taken as a ratio to a decode step run just before it, since a machine's
speed drifts within seconds and the controller decides on ratios (v(n), the draft cost c).
Rounds then refine them as usual. The measurements behind this are in docs/design.md.

Prefix caching. A finished sequence's slot keeps its K/V, and the engine remembers the tokens
they belong to. A new request takes the free slot whose kept tokens share the longest prefix with
its prompt, keeps those positions and prefills only the rest (at least the prompt's last token,
whose logits give the first output token), as llama-server's prompt cache does. This is exact,
not an approximation: with prefix caching on, every prompt is prefilled through the decode path
(``prefill=False``), whose rows depend only on their own token, position and the cache entries
before them, bitwise (the native kernels' contract; :meth:`~verispec.models.decoder.Decoder.
rows_are_pass_invariant`). So an entry computed in an earlier request's prefill or decode step is
the entry a fresh prefill would compute, and a request's output does not depend on what ran
before it. ``prefix_caching=None`` (the default) turns it on where that holds and costs nothing:
a native model on the CPU that keeps no dense prefill copies
(:meth:`~verispec.models.decoder.Decoder.prefills_on_the_decode_kernels`), whose long-prompt
prefill runs the same kernels anyway (1.5B, 700 tokens on the AVX2 EPYC: 8.3-8.6 s through the decode path,
8.7-9.3 s through the prefill path). A drafter that reads every prompt position's hidden
states after prefill (EAGLE) gets none for a cached prefix, so it stays off for it; one that reads
only the last position's (Medusa, ``last_prompt_state_only``) keeps it.

Faults. A failure that belongs to one sequence (its drafter's ``propose``, its verification and
sampling, its commit and stop check, the controller's bookkeeping for it) finishes that
sequence with ``finish_reason == "error"`` and the message in ``seq.error``; the rest of the
batch goes on. A failure of the shared verify forward is retried once for the whole batch
without speculation (a plain step, which gives the same greedy tokens), and if that fails too,
each sequence runs its plain step alone, so only the sequences whose own pass fails are
failed. A retry first rolls every slot back to where the failed pass started. Errors never
leave a slot taken: a failed sequence is released like a finished one, and a drafter's
``finish`` that raises is logged, not propagated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.detokenize import IncrementalDetokenizer
from verispec.engine.batch_k import StepCosts, choose_k
from verispec.engine.sequence import Sequence, common_prefix
from verispec.sampling import logits_to_probs, make_generator
from verispec.speculative.base import (
    EMPTY_PROPOSAL, AuxBranch, Drafter, DrafterContext, Outcome, Proposal, build_drafter,
)
from verispec.speculative.controller import AdaptiveController, Controller, RoundReport, build_controller
from verispec.speculative.cost_model import relative_time, warm_seconds
from verispec.speculative.metrics import SpecMetrics
from verispec.speculative.tree import Tree, tree_layout
from verispec.speculative.tree_verify import verify_tree_greedy, verify_tree_stochastic
from verispec.speculative.verify import VerifyResult, verify_greedy, verify_stochastic

if TYPE_CHECKING:
    from verispec.models.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    result: VerifyResult
    cache_start: int  # target cache length before the verify pass (L)
    path: tuple[int, ...] | None = None  # tree proposals: accepted nodes (root = node 0 excluded)
    aux_logits: torch.Tensor | None = None  # [m, V] logits of the proposal's aux branch
    proposal: Proposal | None = None  # what was verified, when not the drafter's proposal (a retry)
    features: torch.Tensor | None = None  # [n+1, F] the pass's rows (tree: its nodes), for the drafter


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
        self.drafter = drafter
        # Target hidden-state layers the drafter reads (Medusa, EAGLE), in the decoder's
        # numbering: 0 = embeddings, i = after layer i, -1 = the final normed state.
        self.hidden_layers: tuple[int, ...] | None = getattr(drafter, "hidden_layers", None)
        # whether prefill must hand over every prompt position's states (EAGLE) or the last (Medusa)
        self.needs_every_prompt_state = (self.hidden_layers is not None
                                         and not getattr(drafter, "last_prompt_state_only", False))
        self.controller = controller or build_controller(speculative)
        if isinstance(self.controller, AdaptiveController) and hasattr(drafter, "bind_costs"):
            drafter.bind_costs(self.controller.costs)  # lookahead prices its window with them
        if isinstance(self.controller, AdaptiveController) and getattr(drafter, "stops_within_round", False):
            drafter.bind_stop(self._keep_drafting)  # a draft model stops where its drafts stop paying
            self.controller.value_stops = True
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.prefix_caching = self._prefix_caching(prefix_caching)
        reads_prompts_as = getattr(drafter, "reads_prompts_as", None)
        if reads_prompts_as is not None:  # a draft model reads prompts as the target prefills them
            reads_prompts_as(prefill=not self.prefix_caching)
        # per slot, the tokens whose K/V a free slot still holds (its cache's first positions)
        self.kept_tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.kept_at = [0] * max_num_seqs  # when each slot's tokens were kept (a release count)
        self._releases = 0
        self.running: list[Sequence] = []
        self.costs = StepCosts()  # measured costs that batch-aware k is chosen from
        self.metrics = SpecMetrics()  # aggregated over finished requests
        if controller is None and isinstance(self.controller, AdaptiveController) and self.k > 0:
            self._calibrate(self.controller)  # (a controller passed in comes with its own costs)

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
        if not self.free_slots:
            raise RuntimeError(f"all {self.cache.num_slots} sequence slots are in use")
        slot = self._slot_for(prompt_ids)
        seq = self._prefill(prompt_ids, params, slot, num_speculative_tokens)
        self.free_slots.remove(slot)  # the slot is taken only once the prefill has succeeded
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
        batch and free their slot; so do sequences that failed (``finish_reason == "error"``,
        see the module doc on faults).
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
                    self._fail(seq, "drafting", e)
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
                                         depth=_depth(proposal) if proposal.parents is not None else 0)
                    self.controller.observe(seq, report)
                except Exception as e:
                    self._fail(seq, "committing its tokens", e)
        for seq in [s for s in self.running if s.finished]:
            self._release(seq)
        return texts

    # ---- prefix caching ----------------------------------------------------------------------

    def _prefix_caching(self, asked: bool | None) -> bool:
        if asked is False:
            return False
        exact = self.model.rows_are_pass_invariant()
        if asked is None:
            return exact and not self.needs_every_prompt_state and self.model.prefills_on_the_decode_kernels()
        if not exact:
            raise ValueError(
                "prefix caching needs a model whose rows do not depend on the pass that computes them "
                "(float32 on the CPU with the native kernels); this one's would change with it")
        if self.needs_every_prompt_state:
            raise ValueError("prefix caching does not work with a drafter that reads every prompt position's "
                             "hidden states after prefill (EAGLE): a cached prefix has none")
        return True

    def _slot_for(self, prompt_ids: list[int]) -> int:
        """The free slot to prefill ``prompt_ids`` into: the one whose kept tokens share the
        longest prefix with it; when none shares any, an empty slot, else the one whose tokens
        were kept longest ago (least recently used)."""
        if not self.prefix_caching:
            return self.free_slots[-1]
        best, best_len = None, 0
        for slot in reversed(self.free_slots):
            n = common_prefix(self.kept_tokens[slot], prompt_ids)
            if n > best_len:
                best, best_len = slot, n
        if best is not None:
            return best
        empty = [slot for slot in reversed(self.free_slots) if not self.kept_tokens[slot]]
        return empty[0] if empty else min(self.free_slots, key=lambda slot: self.kept_at[slot])

    def _fail(self, seq: Sequence, phase: str, e: Exception) -> None:
        """Finish one sequence with an error (its slot is freed at the end of the step)."""
        log.error("request in slot %d failed while %s", seq.slot, phase, exc_info=e)
        seq.finish_reason = "error"
        seq.error = f"{phase} failed: {type(e).__name__}: {e}"

    # ---- calibration -------------------------------------------------------------------------

    CALIBRATION_CONTEXT = 32  # dummy tokens in the scratch slot's cache before the timed passes

    def _calibrate(self, controller: AdaptiveController) -> None:
        """Seed ``controller.costs`` with warm timings of every verify width 1..k+1 and the
        drafter's costs (see the module doc). Each is timed against a one-position pass run
        just before it (:func:`~verispec.speculative.cost_model.relative_time`), so that the cost
        ratios do not depend on how the host's speed drifted between them. Runs on a free slot,
        which is left empty."""
        slot, device = self.free_slots[-1], self.model.device
        context = min(self.CALIBRATION_CONTEXT, self.max_model_len - self.k - 2)
        token = 0  # any id: only the time matters
        if context < 1:
            return  # no room for a scratch context: the rounds measure everything
        self.cache.reset(slot)
        ids = torch.full((1, context), token, device=device)
        self.model(ids, torch.arange(context, device=device)[None], self.cache, slots=[slot], num_logits=1,
                   prefill=True)

        def verify(n: int) -> None:
            self.model(torch.full((1, n), token, device=device),
                       torch.arange(context, context + n, device=device)[None], self.cache, slots=[slot])
            self.cache.truncate(slot, context)

        def step() -> None:
            verify(1)

        t1 = warm_seconds(step)
        controller.costs.observe_target(1, t1)
        for n in range(2, self.k + 2):
            controller.costs.observe_target(n, t1 * relative_time(lambda: verify(n), step))
        calibrate = getattr(self.drafter, "calibrate", None)
        if calibrate is not None:
            draft_step, reads, resumes = calibrate(slot, token, step)  # in decode steps
            controller.costs.observe_draft(1, draft_step * t1)
            for missed, steps in resumes:
                controller.costs.observe_catch_up(missed, 0, steps * t1)
            for missed, steps in reads:
                controller.costs.observe_catch_up(missed, 0, steps * t1, prompt=missed)
        self.cache.reset(slot)

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
        # positions kept from an earlier request; the prompt's last token is always run, for its logits
        kept = 0
        if self.prefix_caching:
            kept = min(common_prefix(self.kept_tokens[slot], prompt_ids), len(prompt_ids) - 1)
        self.kept_tokens[slot] = list(prompt_ids[:kept])  # what stays valid if this prefill fails
        if kept:
            self.cache.truncate(slot, kept)
        else:
            self.cache.reset(slot)
        seq.metrics.cached_prompt_tokens = kept
        device = self.model.device
        ids = torch.tensor([prompt_ids[kept:]], device=device)  # [1, P - kept]
        positions = torch.arange(kept, len(prompt_ids), device=device)[None]
        # with prefix caching, the decode path: its entries are the ones a later request reuses
        logits, features = self._run(ids, positions, [seq.slot], num_logits=1,
                                     prefill=not self.prefix_caching)  # [1, 1, V]
        if features is not None:
            seq.target_hidden = features[0]  # [P, F]
        result = self._verify_logits(seq, EMPTY_PROPOSAL, logits)
        seq.append(result.committed(0))
        if self.drafter is not None and not seq.finished:
            self.drafter.start(seq)  # per-request set-up (a draft model defers reading the prompt)
        seq.metrics.prefill_time_s += time.perf_counter() - t0
        return seq

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
        if _depth(proposal) > k:
            raise RuntimeError(f"drafter proposed a depth of {_depth(proposal)}, more than the {k} asked for")
        if proposal.values is not None and len(proposal) > 1 and not _fixed_k(seq):
            # The node budget: how many of the tree's best nodes are worth a verify position.
            n = self.controller.choose_nodes(seq, proposal.values, time.perf_counter() - t0)
            if not 1 <= n <= len(proposal):
                raise RuntimeError(f"the controller kept {n} tree nodes, outside 1..{len(proposal)}")
            proposal = _first_nodes(proposal, n)
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
        (see the module doc on faults)."""
        chains = [i for i, p in enumerate(proposals) if p.parents is None and p.aux is None]
        verified: list[Verified | None] = [None] * len(batch)
        seconds = [0.0] * len(batch)
        if chains:
            t0 = time.perf_counter()
            results = self._verify_chains([batch[i] for i in chains], [proposals[i] for i in chains])
            elapsed = time.perf_counter() - t0
            for i, v in zip(chains, results):
                verified[i], seconds[i] = v, elapsed
        for i, (seq, proposal) in enumerate(zip(batch, proposals)):
            if i in chains:
                continue
            t0 = time.perf_counter()
            single = self._verify_tree if proposal.parents is not None else self._verify_aux
            start = self.cache.length(seq.slot)
            try:
                verified[i] = single(seq, proposal)
            except Exception as e:
                log.warning("verify pass of slot %d failed (%s: %s); retrying without speculation",
                            seq.slot, type(e).__name__, e)
                self._roll_back([seq], [start])
                verified[i] = _as_plain(self._verify_chains([seq], [EMPTY_PROPOSAL]))[0]
            seconds[i] = time.perf_counter() - t0
        for i, (seq, s) in enumerate(zip(batch, seconds)):
            seq.metrics.verify_time_s += s / len(chains) if i in chains else s  # a shared pass is split
        return verified, seconds

    def _verify_chains(self, batch: list[Sequence], proposals: list[Proposal]) -> list[Verified | None]:
        """ONE target forward over every sequence's last token and drafts, rows padded to T,
        then each row verified on its own. If the forward raises, the batch runs again without
        drafts, and if that raises too, each sequence runs alone without drafts; a sequence
        whose own pass (or verification) still fails is failed, and its result is None."""
        starts = [self.cache.length(seq.slot) for seq in batch]
        try:
            return self._verify_rows(batch, proposals, starts, self._forward_chains(batch, proposals, starts))
        except Exception as e:
            error = e
        self._roll_back(batch, starts)
        plain = [EMPTY_PROPOSAL] * len(batch)
        if any(len(p) for p in proposals):
            log.warning("verify pass of %d sequence(s) failed (%s: %s); retrying without speculation",
                        len(batch), type(error).__name__, error)
            try:
                return _as_plain(self._verify_rows(batch, plain, starts, self._forward_chains(batch, plain, starts)))
            except Exception as e:
                error = e
            self._roll_back(batch, starts)
        if len(batch) == 1:
            self._fail(batch[0], "its forward pass", error)
            return [None]
        # each alone: only a sequence whose own pass fails is failed
        return [_as_plain(self._verify_chains([seq], [EMPTY_PROPOSAL]))[0] for seq in batch]

    def _roll_back(self, batch: list[Sequence], starts: list[int]) -> None:
        """Undo what a failed forward may have written (it only appends past ``starts``)."""
        for seq, start in zip(batch, starts):
            self.cache.truncate(seq.slot, start)

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
                                         features=row_features))
            except Exception as e:
                self._fail(seq, "verifying and sampling", e)
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
            mask = self._aux_mask(start, len(segment), aux)
        device = self.model.device
        ids = torch.tensor([tokens], device=device)  # [1, n+1+m]
        positions = start + torch.tensor([offsets], device=device)  # [1, n+1+m]
        t0 = time.perf_counter()
        logits, features = self._run(ids, positions, [seq.slot], attn_mask=mask)  # [1, n+1+m, V]
        seq.metrics.record_target(ids.shape[1], time.perf_counter() - t0)
        n1 = len(segment)
        aux_logits = None if aux is None else logits[0, n1:]  # [m, V]
        return Verified(self._verify_logits(seq, proposal, logits[:, :n1]), start, aux_logits=aux_logits,
                        features=None if features is None else features[0, :n1])

    def _aux_mask(self, start: int, n1: int, aux: AuxBranch) -> torch.Tensor:
        """Attention mask [1, n1+m, start+n1+m] for the verify segment followed by an aux branch.

        Worked example, cache length 3, segment [t, d1] (n1 = 2) and 2 aux rows::

            row   cache 0 1 2 | t d1 | a1 a2
            t           1 1 1 | 1 0  | 0  0     (causal, as without the branch)
            d1          1 1 1 | 1 1  | 0  0
            a1          1 1 1 | aux.mask[0]
            a2          1 1 1 | aux.mask[1]
        """
        if self.model.config.sliding_window is not None:
            raise ValueError("aux branches (lookahead) do not support sliding-window attention")
        device, m = self.model.device, len(aux.tokens)
        if len(aux.positions) != m or tuple(aux.mask.shape) != (m, n1 + m):
            raise ValueError(f"aux branch of {m} tokens needs {m} positions and a [{m}, {n1 + m}] mask; got "
                             f"{len(aux.positions)} positions and a {list(aux.mask.shape)} mask")
        mask = torch.ones(n1 + m, start + n1 + m, dtype=torch.bool, device=device)
        mask[:n1, start:] = torch.ones(n1, n1 + m, dtype=torch.bool, device=device).tril()
        mask[n1:, start:] = aux.mask.to(device)
        return mask[None]

    def _verify_logits(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        p = seq.params
        draft = torch.tensor([proposal.tokens], dtype=torch.long, device=logits.device)  # [1, n]
        if p.greedy:
            return verify_greedy(draft, logits)
        target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [1, n+1, V]
        draft_probs = None if proposal.probs is None else proposal.probs[None]  # [1, n, V]
        return verify_stochastic(draft, draft_probs, target_probs, seq.generator)

    def _verify_tree(self, seq: Sequence, proposal: Proposal) -> Verified:
        start = self.cache.length(seq.slot)
        proposal = _first_nodes(proposal, self.max_model_len - start - 1)
        tree = Tree((-1, *proposal.parents))
        layout = tree_layout(tree, start, self.model.device)
        ids = torch.tensor([[seq.output_ids[-1], *proposal.tokens]], device=self.model.device)  # [1, N]
        t0 = time.perf_counter()
        logits, features = self._run(ids, layout.positions[None], [seq.slot], attn_mask=layout.mask[None])
        logits = logits[0]  # [N, V]
        seq.metrics.record_target(len(tree), time.perf_counter() - t0)
        p = seq.params
        if p.greedy:
            result = verify_tree_greedy(tree, proposal.tokens, logits)
        else:
            target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [N, V]
            result = verify_tree_stochastic(tree, proposal.tokens, proposal.probs, target_probs,
                                            proposal.children, seq.generator)
        seq.metrics.record_tree(len(proposal), result.num_accepted)
        as_chain = VerifyResult(torch.tensor([result.num_accepted]), torch.tensor([result.tokens]))
        return Verified(as_chain, start, result.path, features=None if features is None else features[0])

    def _accept(self, seq: Sequence, proposal: Proposal, verified: Verified) -> tuple[Outcome, str]:
        committed, text = seq.append(verified.result.committed(0))
        outcome = Outcome(len(proposal), int(verified.result.num_accepted[0]), committed, verified.aux_logits)
        seq.metrics.record_round(outcome.num_proposed, outcome.num_accepted, len(committed))
        return outcome, text

    def _commit(self, seq: Sequence, verified: Verified, outcome: Outcome) -> None:
        # The pass wrote t, d_1..d_n; keep t and the accepted drafts (the last committed token's
        # K/V is written next round). A tree keeps its root and accepted path, compacted.
        keep = list(range(len(outcome.committed))) if verified.path is None else [0, *verified.path][
            : len(outcome.committed)]  # the pass's rows (tree nodes) of the committed tokens' inputs
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
                log.exception("the drafter failed to drop the state of slot %d", seq.slot)
        kept = self.cache.length(seq.slot)
        if self.prefix_caching and seq.finish_reason != "error" and kept <= len(seq.token_ids):
            # (a chain's or an accepted tree path's cache index is its token's index)
            self.kept_tokens[seq.slot] = seq.token_ids[:kept]
            self._releases += 1
            self.kept_at[seq.slot] = self._releases
        else:
            self.kept_tokens[seq.slot] = []
            self.cache.reset(seq.slot)
        self.free_slots.append(seq.slot)
        self.metrics.merge(seq.metrics)

def _as_plain(verified: list[Verified | None]) -> list[Verified | None]:
    """Mark results of a retry without drafts (their drafter's proposal was not verified)."""
    return [v if v is None else dataclasses.replace(v, proposal=EMPTY_PROPOSAL) for v in verified]


def _fixed_k(seq: Sequence) -> bool:
    """A request that pinned its k, or a seeded sampled one (its seed must reproduce its output),
    drafts a fixed k."""
    return seq.num_speculative_tokens is not None or (seq.params.seed is not None and not seq.params.greedy)

def _depth(proposal: Proposal) -> int:
    """Tokens the proposal can commit before the bonus: its length, or a tree's depth."""
    if proposal.parents is None:
        return len(proposal)
    return max(Tree((-1, *proposal.parents)).depths)


def _first_nodes(proposal: Proposal, n: int) -> Proposal:
    """The tree's first ``n`` nodes (what fits in the cache, or the node budget).

    Exact for every child mode: dropping the last nodes drops, at each node, a suffix of its
    children (and their subtrees), chosen by count alone, never by the drawn tokens. (A node
    budget is chosen from draft values, which only top-k trees carry: their children are not
    drawn, and any subtree picked before the target runs keeps verification exact.)
    """
    if len(proposal) <= n:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:n]
    values = None if proposal.values is None else proposal.values[:n]
    return Proposal(proposal.tokens[:n], probs, proposal.parents[:n], proposal.children, values=values)
