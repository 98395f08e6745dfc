"""A thin wrapper around a Hugging Face tokenizer: ids in, ids out, chat templates, stop tokens.

The engine only needs a handful of operations (encode a prompt, render a chat conversation,
decode ids, know which ids end a generation), so :class:`Tokenizer` exposes exactly those and
keeps the full Hugging Face tokenizer at hand as :attr:`Tokenizer.hf` for anything else.

End-of-generation ids (:attr:`Tokenizer.eos_token_ids`) are the union of

* the tokenizer's own ``eos_token_id``;
* ``eos_token_id`` of ``config.json`` and of ``generation_config.json`` (an int or a list);
* every special token whose text is a well-known end-of-turn / end-of-text marker
  (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ...), the rule llama.cpp uses for its
  end-of-generation set. A GGUF file stores a single eos id, so without this rule an
  instruct model converted from GGUF could miss its chat end token.

A light load. Importing transformers and building its tokenizer take seconds, most of a warm
start. :func:`write_light_tokenizer` (called when a GGUF file's metadata is cached) stores what
the engine needs beside the tokenizer files: the Rust tokenizer exactly as transformers' loaded
tokenizer holds it, the end-of-generation ids, the special tokens and the chat template. A
:class:`Tokenizer` made from it encodes and decodes with the Rust tokenizer directly and renders
chats with transformers' own template renderer (a light import); the same ids and text as
transformers' tokenizer, which it builds only when something asks for :attr:`Tokenizer.hf`.
Only a tokenizer whose ``encode`` and ``decode`` are exactly the Rust tokenizer's (a fast
tokenizer in its default state, no clean-up of decoded spaces) is stored that way.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verispec.models.files import read_json_object

if TYPE_CHECKING:  # importing transformers is slow; only the loader needs it at run time
    from transformers import PreTrainedTokenizerBase

__all__ = ["END_OF_GENERATION_TEXTS", "LIGHT_FILE", "Tokenizer", "collect_eos_ids", "write_light_tokenizer"]

LIGHT_FILE = "verispec_tokenizer.json"  # the facts of a light load (see the module docstring)
# the Rust tokenizer as transformers holds it, where that differs from the saved tokenizer.json
_LIGHT_BACKEND = "verispec_tokenizer_backend.json"
_LIGHT_VERSION = 1

# Special-token texts that end a generation (chat end-of-turn and end-of-text markers).
END_OF_GENERATION_TEXTS: tuple[str, ...] = (
    "<|im_end|>",  # ChatML: Qwen, SmolLM, many fine-tunes
    "<|endoftext|>",  # GPT-2 style end of document (Qwen, SmolLM, Phi)
    "<|eot_id|>",  # Llama 3 end of turn
    "<|eom_id|>",  # Llama 3 end of message (tool call)
    "<|end_of_text|>",  # Llama 3 end of document
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
)


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` may be missing, an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def collect_eos_ids(
    hf: PreTrainedTokenizerBase,
    *config_eos: Any,
) -> frozenset[int]:
    """End-of-generation ids: tokenizer eos, the given config values and known end markers."""
    ids: set[int] = set(_as_id_list(hf.eos_token_id))
    for value in config_eos:
        ids.update(_as_id_list(value))
    for token_id, added in hf.added_tokens_decoder.items():
        if getattr(added, "special", False) and str(added) in END_OF_GENERATION_TEXTS:
            ids.add(int(token_id))
    return frozenset(ids)


class Tokenizer:
    """Encode, decode and chat-template prompts; knows the model's end-of-generation ids."""

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: Iterable[int] | None = None) -> None:
        self._hf: PreTrainedTokenizerBase | None = hf
        self._light: dict[str, Any] | None = None  # the facts of a light load
        self._backend: Any = None  # its Rust tokenizer
        self._directory: Path | None = None
        self.eos_token_ids: frozenset[int] = (
            collect_eos_ids(hf) if eos_token_ids is None else frozenset(int(i) for i in eos_token_ids)
        )

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """transformers' tokenizer (built on first use after a light load)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self._directory), local_files_only=True)
        return self._hf

    @classmethod
    def _from_light(cls, directory: Path, facts: dict[str, Any], config_eos: Iterable[Any]) -> Tokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        tok = cls.__new__(cls)
        tok._hf, tok._light, tok._directory = None, facts, directory
        tok._backend = RustTokenizer.from_file(str(directory / facts["backend"]))
        ids = set(facts["eos_token_ids"])
        for value in config_eos:
            ids.update(_as_id_list(value))
        tok.eos_token_ids = frozenset(ids)
        return tok

    @classmethod
    def from_pretrained(cls, directory: str | Path, hf_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load the tokenizer of a local Hugging Face model directory (never contacts a hub).

        ``hf_config`` is the model's ``config.json`` dict (read from the directory when omitted);
        its ``eos_token_id`` and that of ``generation_config.json`` join the eos set. Raises
        :class:`OSError` or :class:`ValueError` when the files are missing or malformed.
        """
        directory = Path(directory)
        if hf_config is None:
            hf_config = _read_json_if_present(directory / "config.json")
        generation = _read_json_if_present(directory / "generation_config.json")
        facts = _read_json_if_present(directory / LIGHT_FILE)
        backend = facts.get("backend")
        if facts.get("version") == _LIGHT_VERSION and backend and (directory / backend).is_file():
            return cls._from_light(directory, facts, (hf_config.get("eos_token_id"), generation.get("eos_token_id")))
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        eos = collect_eos_ids(hf, hf_config.get("eos_token_id"), generation.get("eos_token_id"))
        return cls(hf, eos)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS where the tokenizer does.

        The ids are those of ``hf.encode``. For a fast tokenizer in its default state they come
        straight from the Rust backend's ``encode_batch_fast``, which is what ``hf.encode`` runs
        apart from character offsets: it tokenizes with the GIL released, computes no offsets
        (about 4x faster on a megabyte of text) and builds one Python list where transformers
        builds three. What holds the GIL is then a few milliseconds per million tokens, so a
        server tokenizing a huge prompt in a worker thread keeps answering.
        """
        backend = self._plain_backend()
        if backend is None:
            return [int(i) for i in self.hf.encode(text, add_special_tokens=add_special_tokens)]
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _plain_backend(self) -> Any:
        """The Rust tokenizer that :meth:`encode` calls directly, or None (see the module function)."""
        return self._backend if self._backend is not None else _plain_backend(self.hf)

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (a tokenizer with several: the one for tools), or None."""
        template = self._light["chat_template"] if self._light is not None else getattr(self.hf, "chat_template", None)
        if isinstance(template, Mapping):
            template = template.get("tool_use") or template.get("default")
        return template or None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, prompt: str | Sequence[Mapping[str, Any]], system: str | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template applied to the conversation, ending with the assistant prompt.

        ``prompt`` is a user message or a list of ``{"role": ..., "content": ...}`` messages;
        ``system`` prepends a system message (an error if the messages already start with one);
        ``tools`` (OpenAI's function definitions) go to the template's ``tools`` variable.
        """
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer of {self.name_or_path!r} has no chat template; "
                "encode a raw prompt with Tokenizer.encode instead"
            )
        messages = _messages(prompt, system)
        if self._light is not None:
            # what apply_chat_template does for one conversation: None-valued keys dropped, the
            # special tokens' texts as template variables
            from transformers.utils.chat_template_utils import render_jinja_template

            messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=self.chat_template,
                                                add_generation_prompt=True, **self._light["special_tokens_map"])
            return rendered[0]
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, prompt: str | Sequence[Mapping[str, Any]], system: str | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation with the generation prompt appended.

        The template already writes every special token it wants (e.g. BOS), so the rendered
        text is encoded without adding special tokens again.
        """
        return self.encode(self.render_chat(prompt, system, tools), add_special_tokens=False)

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for: its text as UTF-8 or, for a piece of a
        multi-byte character (whose text alone is U+FFFD), the bytes the vocabulary spells: in
        byte-level BPE's printable byte alphabet (GPT-2, Qwen, SmolLM) or as a SentencePiece
        byte token (``<0xE2>``)."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = (self._backend.id_to_token(token_id) if self._backend is not None
                 else self.hf.convert_ids_to_tokens(token_id)) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return text.encode("utf-8")

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows, added tokens included (``len(hf)``)."""
        return len(self)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (chat markers, EOS, ...): they never stand for text."""
        added = self._backend.get_added_tokens_decoder() if self._backend is not None else self.hf.added_tokens_decoder
        return frozenset(int(i) for i, token in added.items() if token.special)

    @property
    def bos_token_id(self) -> int | None:
        return self._light["bos_token_id"] if self._light is not None else self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._light["pad_token_id"] if self._light is not None else self.hf.pad_token_id

    @property
    def name_or_path(self) -> str:
        if self._light is not None:
            return self._light["name_or_path"] or "<tokenizer>"
        return str(getattr(self.hf, "name_or_path", "") or "<tokenizer>")

    def __len__(self) -> int:
        return self._light["size"] if self._light is not None else len(self.hf)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, chat_template={self.has_chat_template})"
        )


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _plain_backend(hf: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer when ``hf.encode`` would call it unchanged, else None.

    transformers switches off a truncation or padding stored in the backend and sets its
    ``encode_special_tokens`` from ``split_special_tokens`` before encoding; a backend in
    another state goes through ``hf.encode`` instead.
    """
    if not getattr(hf, "is_fast", False):
        return None
    backend = hf.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(hf, "split_special_tokens", False)):
        return None
    return backend


def write_light_tokenizer(directory: Path) -> bool:
    """Store the facts of a light load beside the tokenizer files in ``directory`` (see the
    module docstring), from the tokenizer a load of ``directory`` gets; False (nothing written)
    where the Rust tokenizer alone would not give transformers' ids and text."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    backend = _plain_backend(hf)
    template = getattr(hf, "chat_template", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False) or isinstance(template, dict):
        return False
    specials = {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    if len(specials) != len(hf.special_tokens_map):  # a list-valued entry: render through transformers
        return False
    from tokenizers import Tokenizer as RustTokenizer

    text = backend.to_str()
    saved = directory / "tokenizer.json"  # the same tokenizer as saved, where it is: no second copy
    # Both texts come from the same serializer, so equal text is the same tokenizer (text that
    # differs in form only costs a second copy); cheaper than comparing the parsed JSON.
    same = saved.is_file() and RustTokenizer.from_file(str(saved)).to_str() == text
    if not same:
        (directory / _LIGHT_BACKEND).write_text(text, encoding="utf-8")
    facts = {
        "version": _LIGHT_VERSION, "backend": saved.name if same else _LIGHT_BACKEND,
        "eos_token_ids": sorted(collect_eos_ids(hf)), "bos_token_id": hf.bos_token_id,
        "pad_token_id": hf.pad_token_id, "size": len(hf), "chat_template": template or None,
        "special_tokens_map": specials, "name_or_path": str(getattr(hf, "name_or_path", "") or ""),
    }  # fmt: skip
    (directory / LIGHT_FILE).write_text(json.dumps(facts, indent=1) + "\n", encoding="utf-8")
    return True


def _messages(prompt: str | Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping) or "role" not in message or \
                    ("content" not in message and "tool_calls" not in message):
                raise ValueError(f"message {i} must be a mapping with 'role' and 'content' (or an assistant's "
                                 f"'tool_calls'), got {message!r}")
            messages.append(dict(message))
        if not messages:
            raise ValueError("the conversation has no messages")
    if system is not None:
        if messages[0]["role"] == "system":
            raise ValueError("a system prompt was given both as `system` and as the first message")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _read_json_if_present(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` if the file does not exist."""
    return read_json_object(path) if path.is_file() else {}
