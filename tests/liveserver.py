"""A live verispec server on 127.0.0.1 serving a tiny random model with a real HF tokenizer.

The tokenizer is a character-level ``tokenizers`` model wrapped in ``PreTrainedTokenizerFast``
with a ChatML template, so text round-trips exactly and every token decodes to printable text.
Servers run uvicorn in a thread on a free port and are stopped (gracefully) at teardown.
"""

from __future__ import annotations

import http.client
import json
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


# A template that renders tools and calls the way Qwen 2.5's does (its parser: hermes), in the
# characters the tiny tokenizer has (others become <|endoftext|>)
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.x }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(chars: list[str] = CHARS, chat_template: str = CHAT_TEMPLATE) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                 chat_template=chat_template)
    return Tokenizer(hf)


def tiny_target_and_draft(chars: list[str] = CHARS, chat_template: str = CHAT_TEMPLATE):
    tokenizer = char_tokenizer(chars, chat_template)
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
             shutdown_grace_s: float = 1.0, chars: list[str] = CHARS, chat_template: str = CHAT_TEMPLATE,
             **app_kwargs):
    """The app of a server on the tiny models (their vocabulary: the specials and ``chars``);
    ``app_kwargs`` go to :func:`build_app`."""
    target, draft = tiny_target_and_draft(chars, chat_template)
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


def raw(server, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    hdrs = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    try:
        return resp.status, dict(resp.getheaders()), json.loads(data)
    except json.JSONDecodeError:
        return resp.status, dict(resp.getheaders()), data
