"""Typed configuration shared by the CLI, the engine and (later) the server.

Each CLI flag maps one-to-one onto a field here. Names follow vLLM / OpenAI where a user would
look for them. Every config validates itself in ``__post_init__`` and raises ``ValueError`` with
a message that names the bad field and the accepted range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    ``temperature == 0`` means greedy decoding. The transforms (temperature, top-k, top-p,
    min-p) are applied by :func:`verispec.sampling.logits_to_probs`, the single function that
    both plain decoding and speculative verification use for the target *and* the draft.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-compatible speculative decoding settings (``--speculative-config`` JSON).

    ``method`` picks a drafter from :mod:`verispec.spec.registry`; the drafter reads the
    fields it needs and ignores the rest.
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Suffix decoding (vLLM's names and defaults; max_cached_tokens is verispec's memory bound:
    # the global store holds at most that many tokens, max_tree_depth trie nodes per token).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 100_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Lookahead decoding: Jacobi window W, n-gram size N, guess set G (n-grams kept per token).
    lookahead_window_size: int = 4
    lookahead_ngram_size: int = 4
    lookahead_guess_set_size: int = 4

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                     "suffix_decoding_max_cached_tokens", "lookahead_window_size", "lookahead_ngram_size",
                     "lookahead_guess_set_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"method must be a non-empty string, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}"
            )
        self._check_suffix_decoding()
        for name, low in (("lookahead_window_size", 1), ("lookahead_ngram_size", 2), ("lookahead_guess_set_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")

    def _check_suffix_decoding(self) -> None:
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError(
                f"suffix_decoding_max_tree_depth must be >= 2 (one matched and one drafted token), "
                f"got {self.suffix_decoding_max_tree_depth}"
            )
        for name in ("suffix_decoding_max_cached_requests", "suffix_decoding_max_cached_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables the global cache), got {getattr(self, name)}")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError(
                f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor}"
            )
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(
                f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}"
            )

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        """Build from a ``--speculative-config`` dict; unknown keys are an error.

        As in vLLM, ``method`` may be left out when ``model`` is given (it means
        ``draft_model``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(data).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown speculative config key(s): {', '.join(unknown)}; valid keys: {', '.join(valid)}"
            )
        data = dict(data)
        if "method" not in data:
            if not data.get("model"):
                raise ValueError('speculative config needs "method" (or "model" for a draft model)')
            data["method"] = "draft_model"
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        return cls.from_dict(data)
