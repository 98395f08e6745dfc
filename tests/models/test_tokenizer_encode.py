"""``Tokenizer.encode`` gives the ids of ``hf.encode`` whichever path it takes, and a light
load (no transformers) gives transformers' ids, text, chat renderings and special ids.

For a fast tokenizer in its default state it calls the Rust backend's ``encode_batch_fast``
directly (no offsets, one list); these tests hold it to transformers' own ``encode`` on the
bundled models' tokenizers and on tokenizers built here, and check that a backend in a state
transformers would change first (stored truncation or padding, split special tokens) takes
transformers' path.
"""

from __future__ import annotations

import pytest

from liveserver import char_tokenizer
from verispec.models import tokenizer as tokenizer_module
from verispec.models.gguf_convert import gguf_metadata
from verispec.models.registry import bundled_path, is_fetched
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


CONVERSATIONS = [
    "Write a haiku about tokenizers.",
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello. <|im_end|> naïve 🙂"}, {"role": "user", "content": "again\n\n  x"}],
]


def same_text_as_transformers(tok: Tokenizer) -> None:
    """Decoding, chat rendering and the special ids, against the tokenizer transformers loads
    from the same directory."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok._directory), local_files_only=True)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    specials = sorted(hf.added_tokens_decoder)
    assert tok.decode(specials, skip_special_tokens=False) == hf.decode(specials, skip_special_tokens=False)
    assert tok.decode(specials, skip_special_tokens=True) == hf.decode(specials, skip_special_tokens=True)
    assert tok.has_chat_template == bool(hf.chat_template)
    if tok.has_chat_template:
        for conversation in CONVERSATIONS:
            messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert tok.render_chat(conversation) == expected
            assert tok.apply_chat_template(conversation) == hf.encode(expected, add_special_tokens=False)
    assert (len(tok), tok.bos_token_id, tok.pad_token_id) == (len(hf), hf.bos_token_id, hf.pad_token_id)
    assert tok.eos_token_ids >= tokenizer_module.collect_eos_ids(hf)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_a_light_load_gives_transformers_ids_and_text(name: str) -> None:
    if not is_fetched(name):
        pytest.skip(f"{name} is not fetched")
    tok = Tokenizer.from_pretrained(gguf_metadata(bundled_path(name), progress=False))
    assert tok._light is not None and tok._hf is None  # no transformers tokenizer was built
    same_text_as_transformers(tok)
    same_as_transformers(tok)


def test_a_load_without_the_light_files_goes_through_transformers(tmp_path) -> None:
    import shutil

    if not is_fetched("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct is not fetched")
    meta = gguf_metadata(bundled_path("smollm2-135m-instruct"), progress=False)
    shutil.copytree(meta, tmp_path / "meta")
    (tmp_path / "meta" / tokenizer_module.LIGHT_FILE).unlink()
    heavy = Tokenizer.from_pretrained(tmp_path / "meta")
    light = Tokenizer.from_pretrained(meta)
    assert heavy._light is None and light._light is not None
    assert heavy.eos_token_ids == light.eos_token_ids
    assert heavy.apply_chat_template(CONVERSATIONS[1]) == light.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
@pytest.mark.parametrize("light", [True, False], ids=["light", "transformers"])
def test_token_bytes_spell_the_text_even_inside_a_character(name: str, light: bool) -> None:
    """Logprobs give each token's bytes; a character split over tokens is in their bytes whole."""
    if not is_fetched(name):
        pytest.skip(f"{name} is not fetched")
    tok = Tokenizer.from_pretrained(gguf_metadata(bundled_path(name), progress=False))
    if not light:
        tok = Tokenizer(tok.hf, tok.eos_token_ids)
    for text in ("héllo → 日本語のテキスト 🙂👍🏽", "def f(x):\n    return x * 2"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), text
