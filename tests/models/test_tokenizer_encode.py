"""``Tokenizer.encode`` gives the ids of ``hf.encode`` whichever path it takes.

For a fast tokenizer in its default state it calls the Rust backend's ``encode_batch_fast``
directly (no offsets, one list); these tests hold it to transformers' own ``encode`` on the
bundled models' tokenizers and on tokenizers built here, and check that a backend in a state
transformers would change first (stored truncation or padding, split special tokens) takes
transformers' path.
"""

from __future__ import annotations

import pytest

from liveserver import char_tokenizer
from verispec.models.tokenizer import Tokenizer

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x * 2  # doubled\n\n\tprint(f(3))",
    "  leading and trailing spaces   ",
    "Unicode: naïve café, 日本語のテキスト, emoji 🙂👍🏽, e\u0301 (combining), ß, İ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> special text in the middle <|im_end|> of a line",
    "numbers 1234567890 3.14159 -42 1e-9",
    "x" * 5000,
]


def same_as_transformers(tok: Tokenizer) -> None:
    for text in TEXTS:
        for special in (True, False):
            expected = tok.hf.encode(text, add_special_tokens=special)
            got = tok.encode(text, add_special_tokens=special)
            assert got == expected, (text[:40], special)
            assert all(type(i) is int for i in got)


def test_the_backend_path_is_taken_for_a_default_fast_tokenizer() -> None:
    tok = char_tokenizer()
    assert tok._plain_backend() is tok.hf.backend_tokenizer
    same_as_transformers(tok)


@pytest.mark.parametrize("fixture", ["smollm", "qwen_target"])
def test_bundled_tokenizers_encode_as_transformers_does(fixture: str, request) -> None:
    tok = request.getfixturevalue(fixture).tokenizer
    assert tok._plain_backend() is not None
    same_as_transformers(tok)
    ids = tok.encode("a long prompt " * 2000)
    assert ids == tok.hf.encode("a long prompt " * 2000)


def test_a_backend_transformers_would_change_goes_through_transformers() -> None:
    truncated = char_tokenizer()
    truncated.hf.backend_tokenizer.enable_truncation(max_length=3)
    padded = char_tokenizer()
    padded.hf.backend_tokenizer.enable_padding(length=40)
    for tok in (truncated, padded):
        assert tok._plain_backend() is None
        assert len(tok.encode("abcdefgh", add_special_tokens=False)) == 8
    split = char_tokenizer()
    split.hf.backend_tokenizer.encode_special_tokens = True  # hf.split_special_tokens is False
    assert split._plain_backend() is None
    assert split.encode("<|im_end|>") == [2]  # one special token, as transformers encodes it
