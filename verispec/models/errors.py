"""Exceptions raised while loading or converting a model.

:class:`ModelLoadError` (a :class:`ValueError`) carries a message naming the path and the
problem; missing files raise :class:`ModelFileNotFoundError`, which is also a
:class:`FileNotFoundError`; an unreadable GGUF file raises :class:`CorruptGGUFError`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SUPPORTED_ARCHITECTURES", "CorruptGGUFError", "ModelFileNotFoundError", "ModelLoadError",
           "UnsupportedModelError"]

# The Hugging Face architectures the decoder runs (named in UnsupportedModelError's messages).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the path and what is wrong."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A model file or directory that loading needs does not exist."""


class CorruptGGUFError(ModelLoadError):
    """The file is not a readable GGUF file (bad magic, truncated, inconsistent)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"corrupt or truncated GGUF file: {path} ({reason})")


class UnsupportedModelError(ValueError):
    """The checkpoint is valid but describes a model verispec cannot run."""
