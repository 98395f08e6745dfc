"""The engine's cache slots: which are free, and what K/V a free slot still holds.

Prefix caching. A finished sequence's slot keeps its K/V, and the table remembers the tokens
they belong to. A new request takes the free slot whose kept tokens share the longest prefix with
its prompt, keeps those positions and prefills only the rest (at least the prompt's last token,
whose logits give the first output token), as llama-server's prompt cache does. This is exact,
not an approximation: with prefix caching on, every prompt is prefilled through the decode path
(``prefill=False``), whose rows depend only on their own token, position and the cache entries
before them, bitwise (the native kernels' contract;
:meth:`~verispec.models.decoder.Decoder.rows_are_pass_invariant`). So an entry computed in an
earlier request's prefill or decode step is the entry a fresh prefill would compute, and a
request's output does not depend on what ran before it.

:func:`prefix_caching_for` decides whether it is on. Asked for nothing (``None``), it is on where
it is exact and costs nothing: a native model on the CPU that keeps no dense prefill copies
(:meth:`~verispec.models.decoder.Decoder.prefills_on_the_decode_kernels`), whose long-prompt
prefill runs the same kernels anyway (docs/serving.md has the measurement). A drafter that reads
every prompt position's hidden states after prefill (EAGLE) gets none for a cached prefix, so it
stays off for it; one that reads only the last position's (Medusa) keeps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.sequence import common_prefix

if TYPE_CHECKING:
    from verispec.models.decoder import Decoder
    from verispec.models.kv_cache import KVCache


def prefix_caching_for(model: Decoder, asked: bool | None, needs_every_prompt_state: bool) -> bool:
    """Whether an engine over ``model`` caches prefixes: ``asked`` False is off; None is on where
    it is exact and free (see the module doc); True is on, or a ``ValueError`` where it is not
    exact."""
    if asked is False:
        return False
    exact = model.rows_are_pass_invariant()
    if asked is None:
        return exact and not needs_every_prompt_state and model.prefills_on_the_decode_kernels()
    if not exact:
        raise ValueError(
            "prefix caching needs a model whose rows do not depend on the pass that computes them "
            "(float32 on the CPU with the native kernels); this one's would change with it")
    if needs_every_prompt_state:
        raise ValueError("prefix caching does not work with a drafter that reads every prompt position's "
                         "hidden states after prefill (EAGLE): a cached prefix has none")
    return True


class SlotTable:
    """Free slots of ``cache`` and, with ``prefix_caching``, the tokens whose K/V each free slot
    holds (its cache's first positions)."""

    def __init__(self, cache: KVCache, num_slots: int, prefix_caching: bool) -> None:
        self.cache = cache
        self.prefix_caching = prefix_caching
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.kept_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self.kept_at = [0] * num_slots  # when each slot's tokens were kept (a release count)
        self._releases = 0

    def choose(self, prompt_ids: list[int]) -> int:
        """The free slot to prefill ``prompt_ids`` into: the one whose kept tokens share the
        longest prefix with it; when none shares any, an empty slot, else the one whose tokens
        were kept longest ago (least recently used)."""
        if not self.prefix_caching:
            return self.free[-1]
        best, best_len = None, 0
        for slot in reversed(self.free):
            n = common_prefix(self.kept_tokens[slot], prompt_ids)
            if n > best_len:
                best, best_len = slot, n
        if best is not None:
            return best
        empty = [slot for slot in reversed(self.free) if not self.kept_tokens[slot]]
        return empty[0] if empty else min(self.free, key=lambda slot: self.kept_at[slot])

    def reuse(self, slot: int, prompt_ids: list[int]) -> int:
        """Keep the positions of ``slot`` that ``prompt_ids`` shares (never its last token, which
        is always run for its logits), drop the rest; return how many were kept."""
        kept = 0
        if self.prefix_caching:
            kept = min(common_prefix(self.kept_tokens[slot], prompt_ids), len(prompt_ids) - 1)
        self.kept_tokens[slot] = list(prompt_ids[:kept])  # what stays valid if this prefill fails
        if kept:
            self.cache.truncate(slot, kept)
        else:
            self.cache.reset(slot)
        return kept

    def copy(self, src: int, dst: int) -> None:
        """Free slot ``dst`` takes a copy of the K/V ``src`` holds (n samples of one prompt share
        its prefill); what ``dst`` kept before is dropped."""
        self.kept_tokens[dst] = []  # what stays valid if this prefill fails
        self.cache.copy(src, dst)

    def take(self, slot: int) -> None:
        """``slot`` holds a running sequence (taken only once its prefill has succeeded)."""
        self.free.remove(slot)

    def release(self, slot: int, token_ids: list[int], reusable: bool) -> None:
        """Free ``slot``, whose cache holds the first positions of ``token_ids``; with prefix
        caching and ``reusable`` (the sequence did not fail) its K/V is kept for later prompts."""
        kept = self.cache.length(slot)
        if self.prefix_caching and reusable and kept <= len(token_ids):
            # (a chain's or an accepted tree path's cache index is its token's index)
            self.kept_tokens[slot] = token_ids[:kept]
            self._releases += 1
            self.kept_at[slot] = self._releases
        else:
            self.kept_tokens[slot] = []
            self.cache.reset(slot)
        self.free.append(slot)
