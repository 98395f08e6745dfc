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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verispec.models.files import read_json_object

if TYPE_CHECKING:  # importing transformers is slow; only the loader needs it at run time
    from transformers import PreTrainedTokenizerBase

__all__ = ["END_OF_GENERATION_TEXTS", "Tokenizer", "collect_eos_ids"]

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
        self.hf = hf
        self.eos_token_ids: frozenset[int] = (
            collect_eos_ids(hf) if eos_token_ids is None else frozenset(int(i) for i in eos_token_ids)
        )

    @classmethod
    def from_pretrained(cls, directory: str | Path, hf_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load the tokenizer of a local Hugging Face model directory (never contacts a hub).

        ``hf_config`` is the model's ``config.json`` dict (read from the directory when omitted);
        its ``eos_token_id`` and that of ``generation_config.json`` join the eos set. Raises
        :class:`OSError` or :class:`ValueError` when the files are missing or malformed.
        """
        from transformers import AutoTokenizer

        directory = Path(directory)
        if hf_config is None:
            hf_config = _read_json_if_present(directory / "config.json")
        generation = _read_json_if_present(directory / "generation_config.json")
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
        """The Rust tokenizer when ``hf.encode`` would call it unchanged, else None.

        transformers switches off a truncation or padding stored in the backend and sets its
        ``encode_special_tokens`` from ``split_special_tokens`` before encoding; a backend in
        another state goes through ``hf.encode`` instead.
        """
        if not getattr(self.hf, "is_fast", False):
            return None
        backend = self.hf.backend_tokenizer
        if backend.truncation is not None or backend.padding is not None:
            return None
        if backend.encode_special_tokens != bool(getattr(self.hf, "split_special_tokens", False)):
            return None
        return backend

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, prompt: str | Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        """The chat template applied to the conversation, ending with the assistant prompt.

        ``prompt`` is a user message or a list of ``{"role": ..., "content": ...}`` messages;
        ``system`` prepends a system message (an error if the messages already start with one).
        """
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer of {self.name_or_path!r} has no chat template; "
                "encode a raw prompt with Tokenizer.encode instead"
            )
        messages = _messages(prompt, system)
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, prompt: str | Sequence[Mapping[str, Any]], system: str | None = None) -> list[int]:
        """Token ids of the rendered conversation with the generation prompt appended.

        The template already writes every special token it wants (e.g. BOS), so the rendered
        text is encoded without adding special tokens again.
        """
        return self.encode(self.render_chat(prompt, system), add_special_tokens=False)

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows, added tokens included (``len(hf)``)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.hf, "name_or_path", "") or "<tokenizer>")

    def __len__(self) -> int:
        return len(self.hf)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, chat_template={self.has_chat_template})"
        )


def _messages(prompt: str | Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
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
