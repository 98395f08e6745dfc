"""Typed configuration shared by the CLI, the engine and (later) the server.

Each CLI flag maps one-to-one onto a field here. Names follow vLLM / OpenAI where a user would
look for them. Every config validates itself in ``__post_init__`` and raises ``ValueError`` with
a message that names the bad field and the accepted range.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verispec.constraints import Grammar

TREE_CHILD_MODES = ("topk", "iid", "without_replacement")
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64 (torch.Generator.manual_seed takes [-2**63, 2**64))
TOP_K_MAX = 2**31 - 1  # any top_k >= the vocabulary keeps every token
MAX_REQUEST_BYTES = 4 * 2**20  # the server's default limit on a request body
PENALTY_MAX = 2.0  # presence and frequency penalties lie in [-PENALTY_MAX, PENALTY_MAX], as OpenAI's
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # 1 disables it
LOGIT_BIAS_MAX = 100.0  # a logit bias lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX], as OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    ``temperature == 0`` means greedy decoding. The transforms (temperature, top-k, top-p,
    min-p) are applied by :func:`verispec.sampling.logits_to_probs`, the single function that
    both plain decoding and speculative verification use for the target *and* the draft.
    Penalties, ``logit_bias`` and ``min_tokens`` change the target's logits before that, at
    every verified position (:mod:`verispec.penalties` defines them and which tokens count).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # end the sequence like EOS does, even with ignore_eos
    seed: int | None = None
    # Return each emitted token's logprob and this many most likely tokens at its position
    # (0: the emitted token's only); None computes none. See :mod:`verispec.logprobs`.
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: subtracted once from each token in the output
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM's: scales the logits of tokens in the prompt or output
    # OpenAI's: (token id, bias in [-100, 100]) pairs added to the logits; a mapping is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # vLLM's: EOS and stop token ids are masked until this many tokens are out
    # What the output must match (structured outputs), applied to every verified position's
    # logits; see :mod:`verispec.constraints`.
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer up to {TOP_K_MAX}, "
                             f"got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (int64), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {sorted(self.stop_token_ids)}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: a complete grammar ends with EOS")
        if self.grammar is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a grammar: a complete grammar ends with EOS, "
                             "which min_tokens would forbid")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_MAX <= getattr(self, name) <= PENALTY_MAX:
                raise ValueError(f"{name} must be in [-{PENALTY_MAX}, {PENALTY_MAX}], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # (past them, logits overflow to infinities)
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        bias = dict(self.logit_bias)  # a mapping or pairs; a repeated id keeps its last bias
        if any(int(t) != t or t < 0 for t in bias):
            raise ValueError(f"logit_bias keys must be token ids (>= 0), got {sorted(bias)[:5]}")
        if any(not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX for b in bias.values()):
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}], "
                             f"got {sorted(bias.values())[:5]}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias.items())))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether penalties, ``logit_bias`` or ``min_tokens`` change the target's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of ``n`` samples of one prompt. Sample 0 is this
        request as it stands (``n = 1`` is unchanged); sample i > 0 gets the seed derived from
        (seed, i) by SHA-256, so seeded samples are reproducible and differ from each other. An
        unseeded sample draws its own fresh seed anyway (:func:`verispec.sampling.make_generator`)."""
        if index == 0 or self.seed is None:
            return self
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little", signed=True)  # int64, SEED_MIN..SEED_MAX
        return replace(self, seed=seed)


DRAFT_HEAD_QUANTIZATIONS = ("none", "int4")  # see SpeculativeConfig.draft_head_quantization


def tree_choices(choices: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """Medusa-style tree choices (tuples of top-k ranks), checked and ordered by depth, then by
    rank tuple: every choice is a non-empty tuple of ranks >= 0 whose proper prefixes are
    choices too. :meth:`verispec.speculative.tree.Tree.from_choices` numbers nodes in this order.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    known: set[tuple[int, ...]] = {()}
    for path in paths:
        if not path or any(r < 0 for r in path):
            raise ValueError(f"a choice must be a non-empty tuple of ranks >= 0, got {path}")
        if path[:-1] not in known:
            raise ValueError(f"choice {path} has no parent choice {path[:-1]}")
        known.add(path)
    return paths


# What `verispec generate` and `verispec serve` run with no speculative flag: model-free suffix
# decoding (over the prompt, the answer so far and earlier answers) under the adaptive
# controller. Outputs are the target's whatever drafts, so the default costs nothing in quality;
# where drafts do not pay the controller stops drafting.
DEFAULT_SPECULATIVE = {"method": "suffix", "num_speculative_tokens": 8}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-compatible speculative decoding settings (``--speculative-config`` JSON).

    ``method`` picks a drafter from :mod:`verispec.speculative.registry`; the drafter reads the
    fields it needs and ignores the rest. With ``adaptive`` (the default) the controller of
    :mod:`verispec.speculative.controller` picks k per request and round, and
    ``num_speculative_tokens`` is the most it may pick; ``adaptive: false`` drafts exactly
    ``num_speculative_tokens`` every round.

    Tree speculation (names from SGLang / vLLM): ``num_speculative_tokens`` is the tree depth,
    ``speculative_eagle_topk`` (alias ``draft_topk``) the branching, ``num_draft_tokens`` the
    node budget (draft tokens per round, root excluded; default: depth * topk; with ``adaptive``
    the most the controller may keep of a dynamic tree, and the depth the most it may draft), and
    ``speculative_token_tree`` a static Medusa-style choices list (tuples of top-k ranks).
    ``tree_children`` says how a node's children are chosen when sampling: ``"topk"`` (the
    draft's top-k, deterministic; dynamic EAGLE-2 trees), ``"without_replacement"`` or
    ``"iid"`` (sampled from q; these need a static shape, see :mod:`verispec.speculative.tree_verify`).

    ``draft_vocab_size`` (``draft_model``; the name SpecForge and EAGLE-3 use for a draft's own
    vocabulary) makes the draft model score only the token ids below it, plus its special tokens:
    a cheaper draft LM head, with the output unchanged (see
    :class:`verispec.speculative.draft_model.DraftVocabulary`). None takes the bundled draft's
    own setting, if it has one, else the whole vocabulary.

    ``draft_head_quantization`` (``draft_model`` with its LM head on the native kernels): ``"int4"``
    requantizes the draft's head (the ids it keeps) to GGUF's Q4_1 with gguf's quantizer when the
    drafter is built, 0.625 bytes a weight against a Q8_0 head's 1.06; ``"none"`` runs the head as
    loaded. Only the draft's proposals can change, so the output stays the target's. None takes
    the bundled draft's own setting, if it has one, else ``"none"``.

    ``enable_suffix_decoding`` (``draft_model``): each round first looks for a suffix draft (the
    ``suffix_decoding_*`` settings) and proposes it when its score, the tokens it expects
    accepted, is at least ``suffix_decoding_min_score``; otherwise the draft model drafts (see
    :mod:`verispec.speculative.hybrid`).
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    quantization: str = "auto"  # the draft model's weights: auto, none, gguf, int8 or int4 (CPU)
    speculative_eagle_topk: int = 1
    num_draft_tokens: int | None = None
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    tree_children: str = "topk"
    draft_vocab_size: int | None = None
    draft_head_quantization: str | None = None

    # Suffix decoding (vLLM's names and defaults; max_cached_tokens is verispec's memory bound:
    # the global store holds at most that many tokens, max_tree_depth trie nodes per token).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 100_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model with suffix decoding first (verispec.speculative.hybrid): a round proposes the
    # suffix draft when its score (expected accepted tokens) is at least min_score.
    enable_suffix_decoding: bool = False
    suffix_decoding_min_score: float = 2.0
    # Lookahead decoding: Jacobi window W, n-gram size N, guess set G (n-grams kept per token).
    lookahead_window_size: int = 4
    lookahead_ngram_size: int = 4
    lookahead_guess_set_size: int = 4

    def __post_init__(self) -> None:
        for name in ("adaptive", "enable_suffix_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.enable_suffix_decoding and self.method != "draft_model":
            raise ValueError(f'enable_suffix_decoding combines suffix decoding with "draft_model", not {self.method!r} '
                             '(method "suffix" runs suffix decoding alone)')
        self._check_tree()
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "speculative_eagle_topk",
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
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"draft_vocab_size must be a positive integer or null, got {size!r}")
        if self.draft_head_quantization not in (None, *DRAFT_HEAD_QUANTIZATIONS):
            raise ValueError(f"draft_head_quantization must be one of {', '.join(DRAFT_HEAD_QUANTIZATIONS)} or null, "
                             f"got {self.draft_head_quantization!r}")
        for name, low in (("lookahead_window_size", 1), ("lookahead_ngram_size", 2), ("lookahead_guess_set_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")

    def _check_suffix_decoding(self) -> None:
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "suffix_decoding_min_score"):
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
        if self.suffix_decoding_min_score <= 0:
            raise ValueError(f"suffix_decoding_min_score must be > 0, got {self.suffix_decoding_min_score}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(
                f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}"
            )

    @property
    def is_tree(self) -> bool:
        return self.speculative_eagle_topk > 1 or self.speculative_token_tree is not None

    @property
    def tree_budget(self) -> int:
        """Draft tokens (tree nodes, root excluded) per round."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        if self.speculative_token_tree is not None:
            return len(self.speculative_token_tree)
        return self.num_speculative_tokens * self.speculative_eagle_topk

    def _check_tree(self) -> None:
        if not isinstance(self.speculative_eagle_topk, int) or self.speculative_eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be an integer >= 1, got {self.speculative_eagle_topk!r}")
        budget = self.num_draft_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= 62):
            # 62 drafts + the root: a verify pass of at most 63 rows.
            raise ValueError(f"num_draft_tokens must be an integer in 1..62, got {budget!r}")
        if self.tree_children not in TREE_CHILD_MODES:
            raise ValueError(f"tree_children must be one of {', '.join(TREE_CHILD_MODES)}, got {self.tree_children!r}")
        tree = self.speculative_token_tree
        if tree is None:
            return
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"speculative_token_tree is not a list of tuples: {e}") from None
        try:
            tree = tuple(tuple(int(r) for r in choice) for choice in tree)
        except (TypeError, ValueError):
            raise ValueError(f"speculative_token_tree must be a list of rank tuples, got {tree!r}") from None
        tree_choices(tree)  # validates prefixes and ranks
        object.__setattr__(self, "speculative_token_tree", tree)

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        """Build from a ``--speculative-config`` dict; unknown keys are an error.

        As in vLLM, ``method`` may be left out when ``model`` is given (it means
        ``draft_model``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(data).__name__}")
        valid = [f.name for f in fields(cls)] + ["draft_topk"]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown speculative config key(s): {', '.join(unknown)}; valid keys: {', '.join(valid)}"
            )
        data = dict(data)
        if "draft_topk" in data:  # SGLang's name for speculative_eagle_topk
            data["speculative_eagle_topk"] = data.pop("draft_topk")
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


@dataclass(frozen=True)
class TrainSettings:
    """``verispec train-drafter``'s settings (see :mod:`verispec.train.drafter`)."""

    num_heads: int = 4
    num_layers: int = 1
    steps: int = 1000
    batch_size: int = 8  # rows per step
    lr: float = 1e-3
    seq_len: int = 512  # tokens per row (text windows; prompts and answers are cut there)
    max_new_tokens: int = 256  # the target's answer per prompt
    held_out: float = 0.1
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    own_lm_heads: bool = False
    # Both methods: the draft vocabulary (the most frequent tokens of the data). EAGLE-3 heads:
    # unrolled steps of the training-time test and the MLP width (0: the target's).
    draft_vocab_size: int = 32768
    ttt_steps: int = 3
    intermediate_size: int = 0
    # Both methods: the learning rate rises linearly over the first warmup_steps; gradients are
    # clipped to max_grad_norm (0: not clipped).
    warmup_steps: int = 0
    max_grad_norm: float = 0.0
    # Train on the first train_rows rows of the training split only (0: all of them), the
    # held-out rows unchanged: a learning curve against the data.
    train_rows: int = 0

    def __post_init__(self) -> None:
        if self.train_rows < 0:
            raise ValueError(f"train_rows must be >= 0, got {self.train_rows}")
        if self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError(f"warmup_steps and max_grad_norm must be >= 0, got {self.warmup_steps}, "
                             f"{self.max_grad_norm}")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0, got {self.intermediate_size}")
        for name in ("ttt_steps", "draft_vocab_size", "num_heads", "steps", "batch_size", "seq_len", "max_new_tokens", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be a fraction in (0, 1), got {self.held_out}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
