"""Streaming detokenization and stop-string handling.

:class:`IncrementalDetokenizer` turns a stream of token ids into a stream of text pieces. A
byte-level tokenizer can split one UTF-8 character over several tokens, and a SentencePiece
tokenizer decodes a token differently depending on what precedes it (the leading-space
marker), so decoding one token at a time is wrong. The standard prefix-offset / read-offset
technique (used by Hugging Face TGI and vLLM) is used instead:

* ``ids[prefix_offset:read_offset]`` is a short window of tokens whose text has already been
  emitted; it gives the new tokens their left context.
* ``ids[read_offset:]`` are the tokens whose text has not been emitted yet.

On each new token the window ``ids[prefix_offset:]`` is decoded and compared with the decode
of ``ids[prefix_offset:read_offset]``; the extra suffix is emitted unless it ends with U+FFFD,
the replacement character a decoder produces for an incomplete UTF-8 sequence. In that case
the text is held back until the following tokens complete the character. After an emission
the window slides forward, so each step decodes only a handful of tokens. (The window grows
only while the text keeps ending in an incomplete sequence, e.g. a run of invalid bytes; the
first complete character releases it, and :meth:`IncrementalDetokenizer.flush` releases it
at the end of generation.) The emitted pieces therefore concatenate to exactly
``tokenizer.decode(generated_ids)`` for byte-level tokenizers.

:class:`StopChecker` sits after the detokenizer. It holds back any tail of the text that could
be the start of a stop string, so a stop string split over several tokens never reaches the
client, and cuts the text right before the first stop string that completes (the stop string
itself is not returned, as in the OpenAI API and vLLM). With several stop strings, the one
that completes first wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens before the first generated token serve as left context.
_INITIAL_CONTEXT_TOKENS = 5
# How much further back the context window may start to avoid starting inside a character.
_MAX_CONTEXT_BACKOFF = 8
# A UTF-8 character has at most 4 bytes, so it spans at most 4 (non-empty) tokens.
_MAX_CHAR_TOKENS = 4


class _Decoder(Protocol):
    """The part of a Hugging Face tokenizer that the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Convert generated token ids to text one token at a time.

    Args:
        tokenizer: a Hugging Face ``PreTrainedTokenizerBase``-like object (only ``decode`` is
            used).
        prompt_ids: the prompt's token ids. The last few of them give the first generated
            tokens their left context; the prompt's own text is never emitted (except a
            character that the prompt leaves incomplete and the generated tokens finish,
            which is emitted whole as generated text).
        skip_special_tokens: passed to ``tokenizer.decode``.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(t) for t in (prompt_ids or ())]
        self._prefix_offset, self._read_offset = self._initial_offsets()
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces: list[str] = []

    def _is_boundary_after(self, pos: int) -> bool:
        """Whether a character ends right before token ``pos`` (checked on the prompt).

        True when some window of 1..4 tokens ending at ``pos`` decodes without a trailing
        U+FFFD: the last character there is complete. (Decoding a longer window could fail on
        an earlier broken character, and a byte-fallback decoder would then turn the whole
        run of byte tokens into U+FFFD.)
        """
        if pos == 0:
            return True
        for k in range(1, min(_MAX_CHAR_TOKENS, pos) + 1):
            if not self._decode(pos - k, pos).endswith(_REPLACEMENT_CHAR):
                return True
        return False

    def _is_boundary_before(self, pos: int, limit: int) -> bool:
        """Whether a character starts at token ``pos`` (looking at most up to ``limit``)."""
        if pos == 0:
            return True
        for k in range(1, min(_MAX_CHAR_TOKENS, limit - pos) + 1):
            if not self._decode(pos, pos + k).startswith(_REPLACEMENT_CHAR):
                return True
        return False

    def _initial_offsets(self) -> tuple[int, int]:
        """``(prefix_offset, read_offset)`` for the prompt, both on character boundaries.

        If the prompt ends inside a character, the read offset moves back to where that
        character starts: the generated token(s) complete it and it is emitted whole, as
        generated text. The context window starts about ``_INITIAL_CONTEXT_TOKENS`` before the
        read offset, moved back off the middle of a character, because a window that starts
        inside one decodes to a leading U+FFFD (a byte-fallback decoder even turns the whole
        following run of byte tokens into U+FFFD). If no boundary is found nearby (invalid
        bytes), the plain offsets are used.
        """
        n = len(self._ids)
        read = next(
            (j for j in range(n, max(n - _MAX_CHAR_TOKENS + 1, 0) - 1, -1)
             if self._is_boundary_after(j)),
            n,
        )
        start = max(read - _INITIAL_CONTEXT_TOKENS, 0)
        prefix = next(
            (c for c in range(start, max(start - _MAX_CONTEXT_BACKOFF, 0) - 1, -1)
             if self._is_boundary_before(c, read)),
            start,
        )
        return prefix, read

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:stop], skip_special_tokens=self._skip_special_tokens
        )

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly ``""``)."""
        self._ids.append(int(token_id))
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # incomplete UTF-8 sequence: wait for the next token(s)
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is still held back (call once, at the end of generation).

        Only an incomplete UTF-8 sequence at the very end of the output is held back, so
        this returns ``""`` unless generation stopped in the middle of a character.
        """
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        piece = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset  # slide the window forward
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """A copy of the prompt ids followed by the generated ids pushed so far."""
        return list(self._ids)


class StopChecker:
    """Detect stop strings in streamed text without ever emitting part of one.

    Args:
        stop: the stop strings (non-empty). The one that completes first in the text wins
            (on a tie, the longer one); the result does not depend on how the text is split
            into pieces.

    Attributes:
        matched: the stop string that ended generation, or ``None``.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._held = ""
        self._stopped = False
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen (later input is ignored)."""
        return self._stopped

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Add newly detokenized text.

        Returns:
            ``(text, stopped)``: the text that is safe to emit now, and whether a stop string
            has completed. When it has, ``text`` ends right before the stop string.
        """
        if self._stopped:
            return "", True
        if not self._stop:
            return new_text, False
        buffer = self._held + new_text

        # The stop string that completes first (smallest end position; on a tie the longer
        # one, which starts earlier). This is where generation would stop if the text arrived
        # one character at a time, so the result does not depend on how it is chunked. Text
        # already emitted cannot contain the start of a stop string (it would have been held
        # back), so searching the buffer is enough.
        best_end, best_len = -1, 0
        for s in self._stop:
            pos = buffer.find(s)  # first occurrence = earliest end for this string
            if pos == -1:
                continue
            end = pos + len(s)
            if best_end == -1 or end < best_end or (end == best_end and len(s) > best_len):
                best_end, best_len, self.matched = end, len(s), s
        if best_end != -1:
            self._stopped = True
            self._held = ""
            return buffer[: best_end - best_len], True

        hold = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - hold:]
        return buffer[: len(buffer) - hold], False

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """Release the held-back text at the end of generation (no stop string was hit)."""
        if self._stopped:
            return ""
        held, self._held = self._held, ""
        return held
