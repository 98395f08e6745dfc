"""A live verispec server on 127.0.0.1 serving a tiny random model with a real HF tokenizer.

The tokenizer is a character-level ``tokenizers`` model wrapped in ``PreTrainedTokenizerFast``
with a ChatML template, so text round-trips exactly and every token decodes to printable text.
Servers run uvicorn in a thread on a free port and are stopped (gracefully) at teardown.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny import tiny_model
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.tokenizer import Tokenizer
from verispec.server.app import build_app
from verispec.server.serve import BackgroundServer
from verispec.speculative.draft_model import DraftModelDrafter

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?-\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
API_KEY = "test-key"
K = 3
MAX_MODEL_LEN = 96


def char_tokenizer(chars: list[str] = CHARS) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                 chat_template=CHAT_TEMPLATE)
    return Tokenizer(hf)


def tiny_target_and_draft(chars: list[str] = CHARS):
    tokenizer = char_tokenizer(chars)
    vocab = len(SPECIALS) + len(chars)
    target = tiny_model(vocab=vocab, seed=1)
    # Special tokens get logit 0 while the largest logit is far above it, so the random model
    # practically never ends early or emits text-less tokens: outputs are long enough to test.
    target.lm_head.weight.data[: len(SPECIALS)] = 0
    draft = tiny_model(vocab=vocab, seed=2, noise_from=target, noise=0.15)
    return (SimpleNamespace(model=target, tokenizer=tokenizer, name="tiny"),
            SimpleNamespace(model=draft, tokenizer=tokenizer, name="tiny-draft"))


class LiveServer(BackgroundServer):
    @property
    def runner(self):
        return self.app.state.runner


def make_app(max_num_seqs: int = 4, max_queue: int = 64, api_key: str | None = API_KEY,
             shutdown_grace_s: float = 1.0, chars: list[str] = CHARS, **app_kwargs):
    """The app of a server on the tiny models (their vocabulary: the specials and ``chars``);
    ``app_kwargs`` go to :func:`build_app`."""
    target, draft = tiny_target_and_draft(chars)
    drafter = DraftModelDrafter(draft, target.model.config.vocab_size, MAX_MODEL_LEN, num_slots=max_num_seqs)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K)
    engine = Engine(target, spec, max_model_len=MAX_MODEL_LEN, drafter=drafter, max_num_seqs=max_num_seqs)
    return build_app(engine, "tiny", api_key=api_key, max_queue=max_queue, shutdown_grace_s=shutdown_grace_s,
                     **app_kwargs)


def make_server(*args, **kwargs) -> LiveServer:
    """A live server (not yet started: use it as a context manager) for :func:`make_app`'s app."""
    return LiveServer(make_app(*args, **kwargs))


def wait_idle(live: LiveServer, timeout: float = 20.0) -> None:
    """Wait until no request is waiting or running, and every slot is free."""
    engine = live.runner.engine
    deadline = time.monotonic() + timeout
    while live.runner.num_active or engine.running:
        assert time.monotonic() < deadline, "requests still active"
        time.sleep(0.02)
    assert sorted(engine.free_slots) == list(range(engine.cache.num_slots))
