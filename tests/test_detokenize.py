"""Tests for :mod:`verispec.detokenize`: streaming detokenization and stop strings.

Two small tokenizers are built inside the test (no download), so characters outside their
tiny vocabularies (accents, CJK, emoji) are split into several byte tokens:

* ``byte_level``: GPT-2 style byte-level BPE, where one token may hold parts of two
  characters;
* ``byte_fallback``: Llama / SentencePiece style BPE with ``<0xNN>`` byte-fallback tokens and
  a ``▁`` word marker whose leading space the decoder strips, so a token decodes
  differently depending on its left context.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verispec.detokenize import IncrementalDetokenizer, StopChecker

_CORPUS = [
    "héllo 世界 🚀 the quick brown fox",
    "jumps over the lazy dog, héllo again",
    "naïve café résumé 世界 hello world",
    "the end of the story is near",
]

_TEXTS = [
    "héllo 世界 🚀",
    "naïve café 😀 déjà vu, 日本語のテキスト and ✨🚀✨ emoji",
    "plain ascii text with the quick brown fox",
    "Ünïcödé 🧪🧬 mixed 中文 text 🚀 again 世界",
]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = metaspace
    base.train_from_iterator(
        _CORPUS * 3, trainers.BpeTrainer(vocab_size=150, limit_alphabet=30, show_progress=False)
    )
    trained = json.loads(base.to_str())["model"]
    # Byte tokens are ordinary vocabulary entries (as in Llama), not special tokens.
    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                               unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    return hf


_BUILDERS = {"byte_level": _byte_level_tokenizer, "byte_fallback": _byte_fallback_tokenizer}


@pytest.fixture(scope="module", params=sorted(_BUILDERS))
def any_tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return _BUILDERS[request.param]()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _byte_level_tokenizer()


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids]


# ---------------------------------------------------------------- IncrementalDetokenizer


def test_tokenizer_splits_multibyte_characters(any_tokenizer: PreTrainedTokenizerFast) -> None:
    # Guard: the other tests only mean something if single tokens decode to broken UTF-8.
    ids = _encode(any_tokenizer, _TEXTS[1])
    assert any("\ufffd" in any_tokenizer.decode([t]) for t in ids)
    for text in _TEXTS:
        assert any_tokenizer.decode(_encode(any_tokenizer, text)) == text


@pytest.mark.parametrize("text", _TEXTS)
def test_stream_equals_full_decode(any_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = _encode(any_tokenizer, text)
    detok = IncrementalDetokenizer(any_tokenizer)
    pieces = _stream(detok, ids)
    assert "".join(pieces) == any_tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert detok.text == text
    assert detok.flush() == ""


@pytest.mark.parametrize("text", _TEXTS)
def test_text_is_emitted_as_soon_as_complete(any_tokenizer: PreTrainedTokenizerFast,
                                             text: str) -> None:
    ids = _encode(any_tokenizer, text)
    detok = IncrementalDetokenizer(any_tokenizer)
    for n, t in enumerate(ids, start=1):
        detok.push(t)
        full = any_tokenizer.decode(ids[:n])
        if not full.endswith("\ufffd"):
            assert detok.text == full
        else:
            # Held back. A byte-fallback decode of an incomplete run is all U+FFFD, so
            # compare with the final text rather than with this prefix's decode.
            assert text.startswith(detok.text)


@pytest.mark.parametrize("text", _TEXTS)
def test_every_prompt_boundary(any_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    # Split the token sequence into prompt + completion at every position, including inside
    # a multi-byte character. The completion's text is what the full decode adds to the
    # prompt's complete characters (a character the completion finishes is completion
    # text), and the prompt context makes word-initial spaces come out right for the
    # byte-fallback decoder.
    ids = _encode(any_tokenizer, text)
    full = any_tokenizer.decode(ids)
    for cut in range(len(ids)):
        boundary = max(j for j in range(cut + 1)
                       if not any_tokenizer.decode(ids[:j]).endswith("\ufffd"))
        assert cut - boundary < 4
        detok = IncrementalDetokenizer(any_tokenizer, prompt_ids=ids[:cut])
        pieces = _stream(detok, ids[cut:])
        assert all("\ufffd" not in p for p in pieces), (cut, pieces)
        assert any_tokenizer.decode(ids[:boundary]) + detok.text == full, (cut, pieces)


def test_with_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = _encode(tokenizer, "héllo 世界 the")
    generated = _encode(tokenizer, " quick 🚀 brown 😀 fox")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    pieces = _stream(detok, generated)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == " quick 🚀 brown 😀 fox"
    assert tokenizer.decode(prompt + generated) == tokenizer.decode(prompt) + detok.text
    assert detok.token_ids == prompt + generated


def test_prompt_ending_mid_character(tokenizer: PreTrainedTokenizerFast) -> None:
    # The prompt/completion boundary may fall inside a character: the completion's first
    # token finishes it, and that character is emitted as part of the generated text.
    ids = _encode(tokenizer, "ab 😀 cd")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
    pieces = _stream(detok, ids[cut:])
    assert all("\ufffd" not in p for p in pieces)
    assert tokenizer.decode(ids[:cut]) == "ab \ufffd"
    assert detok.text == "😀 cd"


def test_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.eos_token_id
    ids = _encode(tokenizer, "héllo") + [eos] + _encode(tokenizer, " 世界")

    skip = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(_stream(skip, ids)) == "héllo 世界"

    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(keep, ids)) == "héllo<eos> 世界"


def test_flush_releases_incomplete_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _encode(tokenizer, "ok 🚀")
    # Drop the last byte token: generation ended in the middle of the emoji.
    ids = ids[:-1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, ids)
    assert all("\ufffd" not in p for p in pieces)
    tail = detok.flush()
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_invalid_bytes_then_valid_character(tokenizer: PreTrainedTokenizerFast) -> None:
    # Stray UTF-8 lead bytes followed by an emoji split over several byte tokens: nothing
    # that a later token could still change is emitted, and the total stays exact.
    lead_byte = tokenizer.convert_tokens_to_ids("ð")  # byte 0xF0, a 4-byte lead
    ids = [lead_byte] * 10 + _encode(tokenizer, "😀 ok")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, ids)
    full = tokenizer.decode(ids)
    assert full.startswith("\ufffd" * 10)
    for n in range(1, len(ids) + 1):
        # Every emitted prefix is a prefix of the final text.
        assert full.startswith("".join(pieces[:n]))
    assert "".join(pieces) + detok.flush() == full


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    class Recording:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            self.lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(_TEXTS) * 10
    ids = _encode(tokenizer, text)
    assert len(ids) > 500
    recording = Recording()
    detok = IncrementalDetokenizer(recording, prompt_ids=ids[:100])
    assert "".join(_stream(detok, ids[100:])) == tokenizer.decode(ids[100:])
    assert max(recording.lengths) <= 12


# ---------------------------------------------------------------- StopChecker


def test_stop_split_across_pushes() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == ("abc ", False)
    assert checker.feed("O") == ("", False)
    assert checker.feed("P and more") == ("", True)
    assert checker.stopped and checker.matched == "STOP"
    assert checker.feed("ignored") == ("", True)
    assert checker.flush() == ""


def test_stop_at_very_start() -> None:
    checker = StopChecker(["<|end|>"])
    assert checker.feed("<|") == ("", False)
    assert checker.feed("end|>tail") == ("", True)

    checker = StopChecker(["hi"])
    assert checker.feed("hi there") == ("", True)


def test_first_completed_stop_wins() -> None:
    checker = StopChecker(["world", "lo w"])
    assert checker.feed("hello world") == ("hel", True)
    assert checker.matched == "lo w"

    checker = StopChecker(["lo w", "hello"])
    assert checker.feed("say hello world") == ("say ", True)
    assert checker.matched == "hello"

    # Same end position: the longer stop string (earlier start) wins.
    checker = StopChecker(["d", "world"])
    assert checker.feed("hello world") == ("hello ", True)
    assert checker.matched == "world"


def test_earliest_complete_stop_wins_over_pending_prefix() -> None:
    # "abcd" could still start at 0, but "c" has already completed: stop now.
    checker = StopChecker(["abcd", "c"])
    assert checker.feed("ab") == ("", False)
    assert checker.feed("cx") == ("ab", True)


def test_overlapping_partial_match() -> None:
    checker = StopChecker(["aab"])
    out = [checker.feed(c) for c in "aaab"]
    assert out == [("", False), ("", False), ("a", False), ("", True)]


def test_false_alarm_is_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == ("abc ", False)
    assert checker.feed("ART") == ("START", False)


def test_no_stop_flush_releases_everything() -> None:
    checker = StopChecker(["STOP", "\n\n"])
    emitted = [checker.feed(p)[0] for p in ("one ", "two S", "TO", "\n")]
    assert "".join(emitted) == "one two STO"  # "STO\n" cannot start "STOP" any more
    assert checker.flush() == "\n"  # could have been the start of "\n\n"
    assert checker.flush() == ""
    assert not checker.stopped and checker.matched is None


def test_no_stop_strings_passthrough() -> None:
    checker = StopChecker([])
    assert checker.feed("anything") == ("anything", False)
    assert checker.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


def test_stop_checker_matches_reference_on_random_splits() -> None:
    rng = random.Random(0)
    alphabet = "ab c"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        # Reference: feed one character at a time, stop as soon as the text contains a stop.
        expected = (text, False)
        for end in range(1, len(text) + 1):
            hits = [s for s in stops if text[:end].endswith(s)]
            if hits:
                expected = (text[: end - max(len(s) for s in hits)], True)
                break

        checker = StopChecker(stops)
        out, stopped, i = [], False, 0
        while i < len(text) and not stopped:
            n = rng.randint(1, 5)
            piece, stopped = checker.feed(text[i:i + n])
            out.append(piece)
            i += n
        if not stopped:
            out.append(checker.flush())
        assert ("".join(out), stopped) == expected, (text, stops)


def test_detokenizer_with_stop_string(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "héllo 世界 🚀 the end of the story"
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer)
    checker = StopChecker(["界 🚀"])  # spans several byte tokens
    emitted: list[str] = []
    for t in ids:
        piece, stopped = checker.feed(detok.push(t))
        emitted.append(piece)
        assert "界" not in piece and "\ufffd" not in piece
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "héllo 世"
