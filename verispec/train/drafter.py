"""``verispec train-drafter``: train speculative heads on a target's own features.

The target stays frozen and only the heads train (Medusa-1; EAGLE-3 likewise):

1. **Data.** Each line of ``--data`` (JSONL) is ``{"prompt": str}``, ``{"messages": [...]}``
   (chat) or ``{"text": str}``; any other file is plain text or code. Prompts are answered by
   the target itself, greedily (self-distillation, as Medusa-2 and EAGLE recommend: the heads
   learn what the target will say, not what some other writer said). Text is cut into windows
   of ``seq_len`` tokens. The token rows are cached in ``OUT/data.pt``, each with its answer
   start (where the target's answer begins; 0 for text).
2. **Features.** The target's hidden states of every row by teacher forcing (one
   prefill-shaped pass per row), cached in ``OUT``: the final normed state for Medusa
   (``features.pt``), three layers for EAGLE-3 (``eagle_features.pt``).
3. **Training.** AdamW over random batches of rows, on
   :func:`~verispec.train.losses.medusa_loss` or on
   :func:`~verispec.train.losses.eagle_loss`, EAGLE-3's training-time test: the head is
   unrolled ``ttt_steps`` steps on its own output states, each step attending as the drafter's
   cache will when it drafts that far. A checkpoint (heads, optimizer, step, random state) is written every
   ``save_every`` steps to ``OUT/checkpoint.pt``; ``--resume`` continues from it. The heads
   are written to ``OUT`` at the end (and with each checkpoint): Medusa heads in the FasterDecoding
   layout, an EAGLE-3 head in vLLM's speculators layout.
4. **Held-out acceptance.** A split of the rows (``held_out``, at least one row) is never
   trained on. Every ``eval_every`` steps it reports each head's (or unrolled step's) top-1
   agreement with the target's next tokens and the mean acceptance length of a greedy chain:
   per position, 1 (the target's own token) plus the number of leading drafts that are right.
   Only the positions whose drafts are answer tokens count (:func:`first_drafted`), so on
   self-distilled rows this is what greedy speculation with these heads would accept on the
   answers. Training scores every position, the prompt's included. ``train_rows`` trains on
   the first rows of the training split only, the held-out rows the same: runs with more and
   fewer rows give acceptance against training data (a learning curve), each with a draft
   vocabulary counted on the rows it reads.

Both methods draft from a reduced vocabulary (``draft_vocab_size``, the data's most frequent
tokens; the whole vocabulary where it is no larger). Medusa heads share the target's LM head by
default (``own_lm_heads=False``), frozen, its rows for those tokens: an LM head of its own is
``draft vocab x hidden`` per head (233M parameters each for the 1.5B target's full vocabulary),
while the ResBlocks are ``hidden^2`` each. An EAGLE-3 head's LM head is initialised from the
target's rows and trains, and its one decoder layer has the MLP width ``intermediate_size``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from verispec.config import TrainSettings
from verispec.models.lm_head import lm_head_weight
from verispec.models.loader import load_model
from verispec.speculative.eagle_head import Eagle3Head, EagleConfig, default_aux_layers, save_eagle
from verispec.speculative.medusa import MedusaHeads, save_medusa
from verispec.train.data import (cached, choose_draft_vocab, read_rows, target_eagle_features,
                                 target_features)
from verispec.train.losses import eagle_loss, eagle_step_hits, eagle_unrolled, medusa_loss, unrolled_loss

# What a resumed run must share with the checkpoint (steps and reporting may change).
RESUME_KEYS = ("num_heads", "num_layers", "batch_size", "lr", "seq_len", "max_new_tokens", "held_out", "seed",
               "own_lm_heads", "ttt_steps", "draft_vocab_size", "intermediate_size", "warmup_steps", "max_grad_norm",
               "train_rows")


@dataclass(frozen=True)
class HeldOut:
    step: int
    loss: float
    head_accuracy: tuple[float, ...]  # top-1 agreement of head i with the token i + 2 ahead
    mean_acceptance_length: float  # greedy chain, bonus token counted

    def line(self) -> str:
        heads = " ".join(f"{a:.2f}" for a in self.head_accuracy)
        return (f"step {self.step}: held-out loss {self.loss:.3f}, head top-1 {heads}, "
                f"mean acceptance length {self.mean_acceptance_length:.2f}")


# ---- held-out evaluation -------------------------------------------------------------------------


def first_drafted(answer_start: int) -> int:
    """The first base position whose drafts are answer tokens. At base t a head has read the
    target's state for x_t (and, for EAGLE, the token x_{t+1}) and drafts x_{t+2} on. Serving
    prefills the prompt (x_0 .. x_{s-1}, s the answer start) and takes x_s from the target, so
    the first drafts are x_{s+1} on, from base s - 1; no token of the prompt, nor x_s, is ever
    drafted. Held-out reports score only bases from here, so they measure what speculation on
    answers would accept, not how well the head predicts the prompt (the chat template's fixed
    tokens, the user's text)."""
    return max(0, answer_start - 1)


@torch.no_grad()
def evaluate(heads: MedusaHeads, features: list[Tensor], rows: list[list[int]], step: int,
             shared_head: Callable[[Tensor], Tensor] | None, answer_starts: list[int] | None = None) -> HeldOut:
    """Held-out report for Medusa heads, over the answer's drafted positions (:func:`first_drafted`;
    every position without ``answer_starts``)."""
    k = heads.num_heads
    correct = torch.zeros(k)
    counted = torch.zeros(k)
    lengths: list[Tensor] = []
    losses = []
    for n, (hidden, row) in enumerate(zip(features, rows)):
        first = first_drafted(answer_starts[n]) if answer_starts else 0
        ids = torch.tensor(row)
        t = len(row)
        usable = t - k - 1  # positions where every head's target token exists
        if t - 2 > first:  # some head has a token to predict from an answer base
            losses.append(medusa_loss(heads, hidden.float()[None], ids[None], shared_head=shared_head,
                                      first_base=first).item())
        if usable <= first:
            continue
        pred = heads.target_ids(heads(hidden.float(), shared_head).argmax(-1))  # [K, T], target ids
        hits = torch.stack([pred[i, first:usable] == ids[first + i + 2 : i + 2 + usable]
                            for i in range(k)])  # [K, usable - first]
        correct += hits.sum(1).float()
        counted += usable - first
        lengths.append(1 + hits.int().cumprod(0).sum(0).float())  # 1 + leading correct heads
    accuracy = tuple((correct / counted.clamp_min(1)).tolist())
    mal = torch.cat(lengths).mean().item() if lengths else 1.0
    return HeldOut(step, sum(losses) / max(len(losses), 1), accuracy, mal)


# ---- training ------------------------------------------------------------------------------------


def _split(rows: list[list[int]], settings: TrainSettings) -> tuple[list[int], list[int]]:
    """Row indices held out and trained on."""
    order = list(range(len(rows)))
    random.Random(settings.seed).shuffle(order)
    n_held = max(1, round(len(rows) * settings.held_out))
    held, train = order[:n_held], order[n_held:]
    if not train:
        raise ValueError(f"{len(rows)} rows leave none to train on after holding out {n_held}")
    if settings.train_rows:
        if settings.train_rows > len(train):
            raise ValueError(f"--train-rows {settings.train_rows}: only {len(train)} rows are left to train on "
                             f"after holding out {n_held} of {len(rows)}")
        train = train[:settings.train_rows]  # the same held-out rows whatever the number trained on
    return held, train


def _vocab_rows(rows: list[list[int]], held: list[int], train: list[int],
                settings: TrainSettings) -> list[list[int]]:
    """The rows the draft vocabulary is counted on: every row, or with ``train_rows`` the rows
    the run reads (so a smaller run's vocabulary owes nothing to rows it never saw)."""
    return [rows[i] for i in sorted(held + train)] if settings.train_rows else rows


def _fit(module: torch.nn.Module, train: list[int], out: Path, settings: TrainSettings, *, resume: bool,
         row_loss: Callable[[int], Tensor], held_out: Callable[[int], HeldOut], write: Callable[[], None],
         log: Callable[[str], None], progress: bool) -> list[HeldOut]:
    """The loop both methods share: AdamW over random batches of the ``train`` rows (one row's
    loss at a time, its gradient accumulated), held-out reports, checkpoints and ``--resume``
    (bit-identical to an uninterrupted run: the optimizer and the batch sampler's state are saved)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    gen = random.Random(settings.seed + 1)
    step = 0
    checkpoint = out / "checkpoint.pt"
    if resume:
        if not checkpoint.is_file():
            raise ValueError(f"--resume: {checkpoint} does not exist")
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        defaults = TrainSettings()  # a checkpoint from before a setting existed ran with its default
        changed = {k for k in RESUME_KEYS if state["settings"].get(k, getattr(defaults, k)) != getattr(settings, k)}
        if changed:
            raise ValueError(f"--resume: {checkpoint} was trained with other {', '.join(sorted(changed))}: "
                             f"{ {k: state['settings'].get(k) for k in sorted(changed)} }")
        module.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        gen.setstate(state["random"])
        log(f"resumed at step {step}")
    reports = [held_out(step)]
    log(reports[-1].line())

    def save() -> None:
        torch.save({"heads": module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "random": gen.getstate(), "settings": asdict(settings)}, checkpoint)
        write()

    bar = None
    if progress:
        bar = tqdm(total=settings.steps, initial=step, desc="train-drafter", unit="step")
    while step < settings.steps:
        batch = [train[gen.randrange(len(train))] for _ in range(settings.batch_size)]
        opt.zero_grad()
        loss = 0.0
        for i in batch:  # one row at a time: a row's logits are T x V per head (GBs for a large vocabulary)
            one = row_loss(i) / len(batch)
            one.backward()
            loss += one.item()
        if settings.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
        for group in opt.param_groups:  # linear warm-up, a function of the step (resumes alike)
            group["lr"] = settings.lr * min(1.0, (step + 1) / settings.warmup_steps) if settings.warmup_steps \
                else settings.lr
        opt.step()
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if step % settings.eval_every == 0 or step == settings.steps:
            reports.append(held_out(step))
            log(reports[-1].line())
        if step % settings.save_every == 0 or step == settings.steps:
            save()
    if bar is not None:
        bar.close()
    (out / "train_report.json").write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return reports


def train_medusa(target, rows: list[list[int]], out: Path, settings: TrainSettings, *, resume: bool = False,
                 features: list[Tensor] | None = None, answer_starts: list[int] | None = None,
                 log: Callable[[str], None] = print, progress: bool = True) -> list[HeldOut]:
    """Train Medusa heads for ``target`` on ``rows``; write checkpoints and the heads to ``out``.
    Returns the held-out reports, the untrained heads' first (step 0). ``answer_starts`` (from
    :func:`read_rows`) limits the reports to the answers' drafted positions."""
    decoder = target.model
    out.mkdir(parents=True, exist_ok=True)
    if features is None:
        features = [target_features(decoder, torch.tensor([r]))[0].to(torch.bfloat16) for r in rows]
    held, train = _split(rows, settings)
    c = decoder.config
    d2t = choose_draft_vocab(_vocab_rows(rows, held, train, settings), c.vocab_size, settings.draft_vocab_size)
    torch.manual_seed(settings.seed)
    heads = MedusaHeads(c.hidden_size, c.vocab_size, settings.num_heads, settings.num_layers,
                        own_lm_heads=settings.own_lm_heads, draft_vocab_size=len(d2t))
    heads.d2t.copy_(d2t)
    # the target's LM-head rows for the draft vocabulary [V_draft, H]: shared and frozen, or where
    # the heads' own LM heads start
    weight = lm_head_weight(decoder).detach().float()[heads.target_ids(torch.arange(len(d2t)))]
    shared = None if settings.own_lm_heads else (lambda x: x @ weight.T)
    heads.init_from_target(weight)
    held_feats, held_rows = [features[i] for i in held], [rows[i] for i in held]
    held_starts = [answer_starts[i] for i in held] if answer_starts else None
    return _fit(
        heads, train, out, settings, resume=resume, log=log, progress=progress,
        row_loss=lambda i: medusa_loss(heads, features[i].float()[None], torch.tensor([rows[i]]), shared_head=shared),
        held_out=lambda step: evaluate(heads, held_feats, held_rows, step, shared, held_starts),
        write=lambda: save_medusa(heads, out, base_model=getattr(target, "name", "")))


def new_eagle_head(decoder, rows: list[list[int]], settings: TrainSettings) -> Eagle3Head:
    """An untrained EAGLE-3 head sized for ``decoder``: its hidden size, heads and RoPE, the
    MLP width ``settings.intermediate_size`` (0: the target's), the draft vocabulary the most
    frequent ``settings.draft_vocab_size`` tokens of the training rows, and the LM head
    initialised from the target's rows for those tokens."""
    c = decoder.config
    d2t = choose_draft_vocab(rows, c.vocab_size, settings.draft_vocab_size)
    config = EagleConfig(
        hidden_size=c.hidden_size, intermediate_size=settings.intermediate_size or c.intermediate_size,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        draft_vocab_size=len(d2t), target_hidden_size=c.hidden_size, aux_layers=default_aux_layers(c.num_layers),
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta)
    torch.manual_seed(settings.seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.lm_head.weight.copy_(lm_head_weight(decoder).detach().float()[head.target_ids(torch.arange(len(d2t)))])
        head.norm.weight.copy_(decoder.norm.weight.float())
    return head


@torch.no_grad()
def evaluate_eagle(head: Eagle3Head, features: list[Tensor], rows: list[list[int]], embed, step: int,
                   steps: int, answer_starts: list[int] | None = None) -> HeldOut:
    """Held-out report for an EAGLE-3 head: each unrolled step's top-1 agreement with the token
    it predicts, and the mean acceptance length of a greedy chain of ``steps`` drafts (1 + the
    leading correct steps, per position), over the answer's drafted positions
    (:func:`first_drafted`; every position without ``answer_starts``)."""
    correct, counted, lengths, losses = torch.zeros(steps), 0, [], []
    for n, (feats, row) in enumerate(zip(features, rows)):
        first = first_drafted(answer_starts[n]) if answer_starts else 0
        ids = torch.tensor([row])
        emb = embed(ids).float()
        unrolled = eagle_unrolled(head, feats.float()[None], ids, emb, steps)  # one pass for both figures
        if len(row) - 2 > first:  # step 0 has a token to predict from an answer base
            losses.append(unrolled_loss(head, unrolled, ids, first_base=first).item())
        hits = eagle_step_hits(head, unrolled, ids, steps)[:, first:]  # [steps, usable - first]
        if hits.shape[1]:
            correct += hits.sum(1).float()
            counted += hits.shape[1]
            lengths.append(1 + hits.int().cumprod(0).sum(0).float())
    mal = torch.cat(lengths).mean().item() if lengths else 1.0
    return HeldOut(step, sum(losses) / max(len(losses), 1), tuple((correct / max(counted, 1)).tolist()), mal)


def train_eagle(target, rows: list[list[int]], out: Path, settings: TrainSettings, *, resume: bool = False,
                features: list[Tensor] | None = None, answer_starts: list[int] | None = None,
                log: Callable[[str], None] = print, progress: bool = True) -> list[HeldOut]:
    """Train an EAGLE-3 head for ``target`` on ``rows`` (the training-time test unrolled
    ``settings.ttt_steps`` steps); write checkpoints and the head (speculators layout) to ``out``.
    ``answer_starts`` as for :func:`train_medusa`."""
    decoder = target.model
    out.mkdir(parents=True, exist_ok=True)
    held, train = _split(rows, settings)
    head = new_eagle_head(decoder, _vocab_rows(rows, held, train, settings), settings)
    if features is None:
        features = [target_eagle_features(decoder, torch.tensor([r]), head.config.aux_layers)[0].to(torch.bfloat16)
                    for r in rows]

    def embed(ids: Tensor) -> Tensor:
        return decoder.embed_tokens(ids).float()

    def row_loss(i: int) -> Tensor:
        ids = torch.tensor([rows[i]])
        return eagle_loss(head, features[i].float()[None], ids, embed(ids), settings.ttt_steps)

    held_feats, held_rows = [features[i] for i in held], [rows[i] for i in held]
    held_starts = [answer_starts[i] for i in held] if answer_starts else None
    return _fit(
        head, train, out, settings, resume=resume, log=log, progress=progress, row_loss=row_loss,
        held_out=lambda step: evaluate_eagle(head, held_feats, held_rows, embed, step, settings.ttt_steps,
                                             held_starts),
        write=lambda: save_eagle(head, out, verifier=getattr(target, "name", ""),
                                 speculative_tokens=settings.ttt_steps))


def run(target_spec: str, method: str, data: Path, out: Path, settings: TrainSettings, *, resume: bool = False,
        quantization: str = "auto", log: Callable[[str], None] = print) -> list[HeldOut]:
    """``verispec train-drafter``: load the target, build or reuse the cached rows and features,
    train, write the heads."""
    if method not in ("medusa", "eagle"):
        raise ValueError(f"train-drafter --method {method}: choose medusa or eagle")
    if not data.is_file():
        raise FileNotFoundError(f"--data {data} does not exist")
    # The target as it will serve (the native kernels by default): its answers come at decode
    # speed, and the heads learn the features they will see.
    target = load_model(target_spec, quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data.read_bytes()).hexdigest()[:16]
    key = json.dumps([target_spec, quantization, digest, settings.seq_len, settings.max_new_tokens,
                      settings.num_heads])
    # The rows with their answer starts (a cache from before the starts were kept is rebuilt).
    rows, starts = cached(out / "data.pt", json.dumps([key, "answer_starts"]),
                           lambda: read_rows(target, data, settings, log))
    log(f"{len(rows)} rows, {sum(map(len, rows))} tokens, "
        f"{sum(len(r) - s for r, s in zip(rows, starts))} of them answers or text")
    if method == "medusa":
        features = cached(out / "features.pt", key, lambda: [
            target_features(target.model, torch.tensor([r]))[0].to(torch.bfloat16) for r in rows])
        return train_medusa(target, rows, out, settings, resume=resume, features=features, answer_starts=starts,
                            log=log)
    layers = default_aux_layers(target.model.config.num_layers)
    features = cached(out / "eagle_features.pt", json.dumps([key, list(layers)]), lambda: [
        target_eagle_features(target.model, torch.tensor([r]), layers)[0].to(torch.bfloat16) for r in rows])
    return train_eagle(target, rows, out, settings, resume=resume, features=features, answer_starts=starts,
                       log=log)
