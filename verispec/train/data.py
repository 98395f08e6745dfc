"""What the heads train on: token rows, the draft vocabulary, and the target's features.

Rows come from ``--data`` (module doc of :mod:`verispec.train.drafter`): prompts answered by the
target itself, greedily, through the engine, and text cut into windows. Each row keeps its answer
start, where the target's answer begins (0 for text, which is all answer). Features are the
target's hidden states of a row by teacher forcing: the final normed state for Medusa, three
layers for EAGLE-3. Both are cached on disk (:func:`cached`) while their inputs are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from verispec.config import SamplingParams, TrainSettings
from verispec.engine.engine import Engine

ANSWER_BATCH = 8  # prompts answered at once


def read_rows(target, data: Path, settings: TrainSettings,
              log: Callable[[str], None] = print) -> tuple[list[list[int]], list[int]]:
    """Token rows from ``data`` (module doc): prompts answered by the target, text windows. Also
    each row's answer start: the index of the target's first answer token in the row (0 for a text
    window, which is all answer)."""
    tok = target.tokenizer
    prompts: list[list[int]] = []
    rows: list[list[int]] = []
    starts: list[int] = []

    def add_text(text: str) -> None:  # windows of text, all answer
        windows = _windows(tok.encode(text), settings.seq_len)
        rows.extend(windows)
        starts.extend([0] * len(windows))

    if data.suffix == ".jsonl":
        for n, line in enumerate(data.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{data}:{n}: not JSON: {e}") from None
            if not isinstance(item, dict):
                raise ValueError(f"{data}:{n}: expected an object with prompt, messages or text")
            if isinstance(item.get("prompt"), str):
                prompts.append(tok.apply_chat_template(item["prompt"]) if tok.has_chat_template
                               else tok.encode(item["prompt"]))
            elif isinstance(item.get("messages"), list):
                prompts.append(tok.apply_chat_template(item["messages"]))
            elif isinstance(item.get("text"), str):
                add_text(item["text"])
            else:
                raise ValueError(f"{data}:{n}: expected a string prompt, a messages list or a string text")
    else:
        add_text(data.read_text(encoding="utf-8", errors="replace"))
    if prompts:
        # Answered ANSWER_BATCH at a time (continuous batching): greedy rows do not depend on the
        # batch, and a batch of rows decodes in much less time than its rows one by one.
        engine = Engine(target, max_model_len=settings.seq_len + settings.max_new_tokens + 1,
                        max_num_seqs=ANSWER_BATCH)
        params = SamplingParams(temperature=0.0, max_tokens=settings.max_new_tokens)
        waiting = [p[-settings.seq_len:] for p in prompts]
        running: dict = {}
        answered = 0
        while waiting or running:
            while waiting and len(running) < ANSWER_BATCH:
                prompt = waiting.pop(0)
                running[engine.add_request(prompt, params)] = prompt
            engine.step()
            for seq in [s for s in running if s.finished]:
                if seq.finish_reason == "error":
                    raise RuntimeError(f"self-distillation failed: {seq.error}")
                rows.append((running.pop(seq) + seq.output_ids)[-settings.seq_len:])
                starts.append(max(0, len(rows[-1]) - len(seq.output_ids)))  # the answer ends the row
                answered += 1
                log(f"self-distillation: answered prompt {answered}/{len(prompts)} ({len(seq.output_ids)} tokens)")
    shortest = max(settings.num_heads, settings.ttt_steps) + 2
    kept = [i for i, r in enumerate(rows) if len(r) >= shortest]
    if len(kept) < 2:
        raise ValueError(f"{data} gives {len(kept)} usable row(s); training needs at least 2 "
                         f"(one is held out), each of at least {shortest} tokens")
    return [rows[i] for i in kept], [starts[i] for i in kept]


def _windows(ids: list[int], length: int) -> list[list[int]]:
    return [ids[i : i + length] for i in range(0, len(ids), length)]


def cached(path: Path, key: str, build: Callable[[], object]) -> object:
    """``build()``, stored in ``path`` under ``key`` and reused while the key matches."""
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved.get("key") == key:
            return saved["value"]
    value = build()
    torch.save({"key": key, "value": value}, path)
    return value


def choose_draft_vocab(rows: list[list[int]], vocab_size: int, size: int) -> Tensor:
    """The ``size`` target ids most frequent in ``rows`` (ties: the lower id), ascending, as a
    ``d2t`` offset table ``[size]`` (draft id i is target id ``i + d2t[i]``)."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(torch.tensor(row, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    ids = torch.tensor(sorted(order), dtype=torch.long)
    return ids - torch.arange(size)


# ---- the target's features (teacher forcing) ------------------------------------------------------


def target_features(decoder, rows: Tensor) -> Tensor:
    """The target's final normed hidden states for token rows ``[N, T]`` (teacher forcing):
    ``[N, T, H]`` float32, detached from inference mode so heads can train on them."""
    cache = decoder.new_cache(rows.shape[1], num_slots=rows.shape[0])
    positions = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    out = decoder(rows, positions, cache, num_logits=1, output_hidden_states=True, prefill=True)
    return out.hidden_states[-1].float().clone()


def target_eagle_features(decoder, rows: Tensor, layers: tuple[int, ...]) -> Tensor:
    """The target's features at ``layers`` for token rows ``[N, T]`` by teacher forcing:
    ``[N, T, 3 * H_target]`` float32, outside inference mode so a head can train on them."""
    cache = decoder.new_cache(rows.shape[1], num_slots=rows.shape[0])
    positions = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    out = decoder(rows, positions, cache, num_logits=1, output_hidden_states=True, prefill=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1).float().clone()
