"""Figures, equality check, report files and the diff of two reports.

Figures per method, per category and ``overall`` (all runs of every turn and repeat pooled):

* ``tok_s`` -- generated tokens / wall time of the whole call (prefill included; end to end);
  ``decode_tok_s`` -- tokens after the first / (wall time - prefill). Prefill ends when the
  first token exists, so for verispec methods it includes the drafter's ``start``; for
  transformers' assisted generation, whose first push is a whole round, the tokens of that
  push count as prefill output.
* ``speedup`` / ``decode_speedup`` -- the method's tok/s over verispec ``plain``'s, same runs.
* ``mean_acceptance_length``, ``acceptance_rate``, ``per_position_acceptance``, ``c`` and
  ``alpha`` -- from the pooled :class:`~verispec.metrics.SpecMetrics` (verispec methods
  only), with T_target(1) taken from plain decoding in the same category;
  ``draft_share`` / ``verify_share`` -- drafting (a draft model's catching up included) /
  verify-pass time over decode time.
* ``identical`` -- at T = 0, how many runs are token-identical to plain decoding's answer to
  the same turn of the same question in the same repeat (plain itself is compared with its
  first repeat), and ``first_divergence`` (question, turn, repeat, token index). transformers
  and llama.cpp run other kernels, so their greedy answers may part from verispec's after a
  near tie in the logits; the report shows that, it does not hide it.
* ``tok_s_by_repeat`` -- overall tok/s of each repeat, so drift over the run is visible.
* ``tok_per_step`` / ``speed_adjusted_speedup`` -- generated tokens per plain decode step, each
  run's wall time counted in the decode steps T(1) it measured itself (the verify phase of its
  rounds that verified one position), and that over plain's: the machine's speed drifts between
  the runs of a block (on a shared host a decode step may be much slower in one run than in the
  next), and counted in its own steps a run's speed cancels. Only where every run of the
  method had at least ``MIN_T1_ROUNDS`` such rounds (plain, prompt lookup, adaptive methods
  that ran plain rounds; not a draft model drafting every round); else None.

The report's ``drift`` holds, over the question blocks, the median and largest ratio of the
slowest to the fastest T(1) measured by the runs of one block: how far apart in speed the
methods compared side by side really ran.

Goals: every verispec answer at T = 0 identical to plain, and the ratios of :class:`Goals`, each
held to the threshold the caller gives (``verispec bench --goal-*``; a report without one shows
the ratio only): verispec's best speculative method over the best ``hf:assisted`` tok/s,
verispec plain over ``hf:plain``. ``vs_peers`` puts verispec's fastest method overall against
each other engine's method (transformers, llama.cpp, an ``openai:*`` server), overall and per
category. When the methods hold a drafter both adaptive (the default) and with fixed k
(``adaptive=false``), otherwise alike, each adaptive variant is also set against the best fixed
k in every category and overall, and against plain in every category.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.bench.goals import Goals, judged
from verispec.bench.methods import PLAIN, MethodSpec, TurnResult
from verispec.bench.runner import BenchResult, Run, Settings
from verispec.bench.plots import plot_acceptance, plot_speedup
from verispec.bench.workloads import OVERALL, Workload
from verispec.config import SpeculativeConfig
from verispec.metrics import SpecMetrics

STEERING_OPTIONS = ("k", "num_speculative_tokens", "adaptive")  # what may differ within a family
MIN_T1_ROUNDS = 5  # one-position rounds a run needs for its own T(1) to count


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(runs: list[Run], greedy: bool) -> list[int | None | str]:
    """Per run: None (identical to plain), the first differing index, or "n/a" (no reference)."""
    plain = {(r.question_id, r.turn, r.repeat): r.result.output_ids for r in runs if r.method == PLAIN}
    out: list[int | None | str] = []
    for r in runs:
        ref = plain.get((r.question_id, r.turn, 0 if r.method == PLAIN else r.repeat))
        out.append("n/a" if not greedy or ref is None else first_divergence(r.result.output_ids, ref))
    return out


def aggregate(runs: list[Run], div: list, labels: list[str], categories: list[str]) -> dict:
    results: dict[str, dict[str, dict]] = {}
    for label in labels:
        results[label] = {}
        for cat in [*categories, OVERALL]:
            idx = [i for i, r in enumerate(runs) if r.method == label and cat in (OVERALL, r.category)]
            if idx:
                plain = results[PLAIN].get(cat) if label != PLAIN else None
                results[label][cat] = _figures([runs[i] for i in idx], [div[i] for i in idx], plain)
    return results


def _figures(sel: list[Run], div: list, plain: dict | None) -> dict:
    tokens = sum(len(r.result.output_ids) for r in sel)
    total = sum(r.result.total_s for r in sel)
    decode = total - sum(r.result.prefill_s for r in sel)
    decode_tokens = sum(max(len(r.result.output_ids) - r.result.first_tokens, 0) for r in sel)
    tok_s = tokens / total if total > 0 else None
    decode_tok_s = decode_tokens / decode if decode > 0 and decode_tokens else None
    fig: dict[str, Any] = {
        "questions": len({r.question_id for r in sel}), "turns": len(sel), "output_tokens": tokens,
        "total_s": total, "decode_s": decode, "tok_s": tok_s, "decode_tok_s": decode_tok_s,
        "speedup": _ratio(tok_s, plain["tok_s"]) if plain else (1.0 if tok_s else None),
        "decode_speedup": _ratio(decode_tok_s, plain["decode_tok_s"]) if plain else (1.0 if decode_tok_s else None),
    }
    merged = SpecMetrics()
    have_metrics = all(r.result.metrics is not None for r in sel)
    for r in sel:
        if r.result.metrics is not None:
            merged.merge(r.result.metrics)
    fig["_t1"] = merged.target_step_time(1)
    s = merged.summary(plain["_t1"] if plain else None) if have_metrics else {}
    for key in ("mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "c", "alpha",
                "target_step_time_s", "draft_time_s", "catch_up_time_s", "verify_time_s"):
        fig[key] = s.get(key)
    fig["draft_share"] = _ratio(s.get("draft_time_s"), decode) if have_metrics else None
    fig["verify_share"] = _ratio(s.get("verify_time_s"), decode) if have_metrics else None
    compared = [(r, d) for r, d in zip(sel, div) if d != "n/a"]
    diverged = [(r, d) for r, d in compared if d is not None]
    fig["compared"] = len(compared)
    fig["identical"] = len(compared) - len(diverged) if compared else None
    fig["first_divergence"] = ({"question_id": diverged[0][0].question_id, "turn": diverged[0][0].turn,
                                "repeat": diverged[0][0].repeat, "index": diverged[0][1]} if diverged else None)
    steps = [_own_steps(r) for r in sel]
    fig["tok_per_step"] = tokens / sum(steps) if None not in steps and sum(steps) > 0 else None
    fig["speed_adjusted_speedup"] = (_ratio(fig["tok_per_step"], plain["tok_per_step"]) if plain
                                     else (1.0 if fig["tok_per_step"] else None))
    repeats = sorted({r.repeat for r in sel})
    fig["tok_s_by_repeat"] = [_ratio(sum(len(r.result.output_ids) for r in sel if r.repeat == k),
                                     sum(r.result.total_s for r in sel if r.repeat == k)) for k in repeats]
    return fig


def _own_t1(r: Run) -> float | None:
    """The run's own decode step: mean verify time of its one-position rounds, if it had enough."""
    m = r.result.metrics
    if m is None or m.target_time_by_n.get(1, (0, 0.0))[0] < MIN_T1_ROUNDS:
        return None
    return m.target_step_time(1)


def _own_steps(r: Run) -> float | None:
    """The run's wall time in its own decode steps."""
    t1 = _own_t1(r)
    return r.result.total_s / t1 if t1 else None


def drift(runs: list[Run]) -> dict:
    """Over the blocks (question, repeat): slowest over fastest T(1) among the block's runs."""
    blocks: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        t1 = _own_t1(r)
        if t1:
            blocks.setdefault((r.question_id, r.repeat), []).append(t1)
    spreads = sorted(max(t) / min(t) for t in blocks.values() if len(t) > 1)
    return {"blocks": len(spreads), "t1_spread_median": spreads[len(spreads) // 2] if spreads else None,
            "t1_spread_max": spreads[-1] if spreads else None}


# Prompt tokens a server may report cached beyond what this run's own requests explain before
# its K/V counts as kept from before the run (a re-tokenized answer can shift a few tokens).
STALE_CACHE_SLACK = 16


def stale_caches(runs: list[Run]) -> dict[str, dict]:
    """Per method whose engine or server reported cached prompt tokens beyond what the run's own
    earlier requests could have left (``Run.reusable_prompt_tokens``, plus ``STALE_CACHE_SLACK``):
    how many turns and prompt tokens. Such a server kept prompts from an earlier run (llama-server
    keeps them in memory), so it skipped prefill work a fresh one would do and its figures are
    not comparable; the report warns. Empty when every server's cache is explained."""
    out: dict[str, dict] = {}
    for r in runs:
        cached, reusable = r.result.cached_prompt_tokens, r.reusable_prompt_tokens
        if cached is None or reusable is None or cached <= reusable + STALE_CACHE_SLACK:
            continue
        s = out.setdefault(r.method, {"turns": 0, "excess_tokens": 0, "prompt_tokens": 0})
        s["turns"] += 1
        s["excess_tokens"] += cached - reusable
        s["prompt_tokens"] += r.prompt_tokens
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(results: dict, specs: list[MethodSpec], greedy: bool, thresholds: Goals = Goals()) -> dict:
    def overall(pred) -> list[tuple[float, str]]:
        return sorted(((results[s.label][OVERALL]["tok_s"] or 0.0, s.label) for s in specs
                       if pred(s) and OVERALL in results[s.label]), reverse=True)

    ours = overall(lambda s: s.backend == "verispec" and not s.is_plain)
    assisted = overall(lambda s: s.backend == "hf" and s.name == "assisted")
    plain, hf_plain = overall(lambda s: s.is_plain), overall(lambda s: s.backend == "hf" and s.name == "plain")

    def goal(a: list, b: list, target: float | None) -> dict:
        value = _ratio(a[0][0], b[0][0]) if a and b else None
        return {"ours": a[0][1] if a else None, "theirs": b[0][1] if b else None, "ratio": value,
                **judged(value, target)}

    ours_runs = [(s.label, results[s.label].get(OVERALL, {})) for s in specs if s.backend == "verispec"]
    compared = sum(f.get("compared") or 0 for _, f in ours_runs)
    same = sum(f.get("identical") or 0 for _, f in ours_runs)
    return {
        "best_verispec_vs_hf_assisted": goal(ours, assisted, thresholds.vs_hf_assisted),
        "verispec_plain_vs_hf_plain": goal(plain, hf_plain, thresholds.plain_vs_hf_plain),
        "verispec_t0_identical": {"identical": same, "compared": compared,
                                  "met": (same == compared) if greedy and compared else None},
        "adaptive_vs_fixed": adaptive_goals(results, specs, thresholds),
        "vs_peers": against_peers(results, specs, overall(lambda s: s.backend == "verispec")),
    }


def against_peers(results: dict, specs: list[MethodSpec], ours: list[tuple[float, str]]) -> list[dict]:
    """verispec's fastest method overall (plain included) against each other engine's method, end
    to end tok/s, overall and per category, and the category where it does worst."""
    if not ours:
        return []
    best = results[ours[0][1]]
    out = []
    for s in specs:
        if s.backend == "verispec" or OVERALL not in results[s.label]:
            continue
        ratios = {c: _ratio(best.get(c, {}).get("tok_s"), f.get("tok_s")) for c, f in results[s.label].items()}
        cats = {c: r for c, r in ratios.items() if c != OVERALL and r is not None}
        lowest = min(cats, key=cats.get) if cats else None
        out.append({"peer": s.label, "ours": ours[0][1], "per_category": ratios,
                    "lowest_category": lowest, "lowest": cats.get(lowest)})
    return out


def adaptive_families(specs: list[MethodSpec]) -> dict[str, tuple[list[str], list[str]]]:
    """verispec drafters run both adaptive and with a fixed k, all else alike:
    family label (the method without k / adaptive) -> (adaptive labels, fixed-k labels)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for s in specs:
        if s.backend != "verispec" or s.is_plain:
            continue
        rest = {k: v for k, v in s.options.items() if k not in STEERING_OPTIONS}
        family = MethodSpec(s.backend, s.name, s.arg, rest).label
        adaptive = s.options.get("adaptive", SpeculativeConfig.adaptive)
        families.setdefault(family, ([], []))[0 if adaptive else 1].append(s.label)
    return {f: members for f, members in families.items() if all(members)}


def adaptive_goals(results: dict, specs: list[MethodSpec], thresholds: Goals = Goals()) -> list[dict]:
    """Each adaptive method against the best of its family's fixed k, per category (end to end
    speedups over plain, the same runs)."""
    out = []
    for family, (adaptive, fixed) in adaptive_families(specs).items():
        for label in adaptive:
            per_cat = {}
            for cat, fig in results[label].items():
                best = max(fixed, key=lambda f: results[f].get(cat, {}).get("speedup") or 0.0)
                best_speedup = results[best].get(cat, {}).get("speedup")
                per_cat[cat] = {"adaptive": fig["speedup"], "best_fixed": best, "best_fixed_speedup": best_speedup,
                                "vs_best": _ratio(fig["speedup"], best_speedup)}
            if not per_cat:
                continue
            cats = [c for c in per_cat if c != OVERALL]
            lowest = min((per_cat[c]["adaptive"] or 0.0 for c in cats), default=None)
            lowest_vs_best = min((per_cat[c]["vs_best"] or 0.0 for c in cats), default=None)
            overall = per_cat.get(OVERALL, {}).get("vs_best")
            out.append({
                "family": family, "adaptive": label, "fixed": fixed, "per_category": per_cat,
                "within_best": {"lowest": lowest_vs_best, **judged(lowest_vs_best, thresholds.adaptive_within_best)},
                "over_best_overall": {"ratio": overall, **judged(overall, thresholds.adaptive_over_best)},
                "vs_plain": {"lowest": lowest, **judged(lowest, thresholds.adaptive_vs_plain)},
            })
    return out


def report_header(specs: list[MethodSpec], workload: Workload, settings: Settings) -> dict:
    """What was asked for: settings, questions and methods (also what ``--resume`` checks)."""
    categories = list(dict.fromkeys(q.category for q in workload.questions))
    cut = {} if workload.max_turns is None else {"max_turns": workload.max_turns}  # absent when unset
    nucleus = {"top_p": settings.top_p} if settings.top_p < 1 else {}  # absent when off
    return {
        "settings": {"max_tokens": settings.max_tokens, "temperature": settings.temperature,
                     "repeats": settings.repeats, "seed": settings.seed, "warmup": settings.warmup, **cut,
                     **nucleus},
        "workload": {"name": workload.name, "source": workload.source, "categories": categories,
                     "questions": [{"question_id": q.question_id, "category": q.category, "turns": len(q.turns)}
                                   for q in workload.questions]},
        "methods": [{"label": s.label, "backend": s.backend, "name": s.name, "arg": s.arg, "options": s.options}
                    for s in specs],
    }


def build_report(result: BenchResult, specs: list[MethodSpec], workload: Workload, settings: Settings,
                 meta: dict, thresholds: Goals = Goals()) -> dict:
    """Everything about one benchmark run, as one JSON-ready dict; its ratios held to ``thresholds``."""
    labels = [s.label for s in specs]
    categories = list(dict.fromkeys(q.category for q in workload.questions))
    greedy = settings.temperature == 0
    div = divergences(result.runs, greedy)
    results = aggregate(result.runs, div, labels, categories)
    for by_cat in results.values():
        for fig in by_cat.values():
            fig.pop("_t1")
    done = {(r.question_id, r.repeat) for r in result.runs}
    return {
        "partial": result.partial,
        **meta,
        **report_header(specs, workload, settings),
        "blocks_done": len(done),
        "blocks_planned": len(workload.questions) * settings.repeats,
        "wall_s": result.wall_s,
        "results": results,
        "drift": drift(result.runs),
        "stale_caches": stale_caches(result.runs),
        "goals": goals(results, specs, greedy, thresholds),
        "runs": [
            {"method": r.method, "question_id": r.question_id, "category": r.category, "turn": r.turn,
             "repeat": r.repeat, "order": r.order, "prompt_tokens": r.prompt_tokens,
             "output_tokens": len(r.result.output_ids), "total_s": r.result.total_s,
             "prefill_s": r.result.prefill_s, "finish_reason": r.result.finish_reason,
             "mean_acceptance_length": r.result.metrics.mean_acceptance_length if r.result.metrics else None,
             "first_divergence": None if d == "n/a" else d, "compared": d != "n/a",
             "output_ids": r.result.output_ids, "first_tokens": r.result.first_tokens,
             "cached_prompt_tokens": r.result.cached_prompt_tokens, "reusable_prompt_tokens": r.reusable_prompt_tokens,
             "metrics": r.result.metrics.to_dict() if r.result.metrics else None}
            for r, d in zip(result.runs, div)
        ],
    }


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _times(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _identical(fig: dict) -> str:
    if fig["identical"] is None:
        return "n/a"
    text = f"{fig['identical']}/{fig['compared']}"
    d = fig["first_divergence"]
    if d:
        text += f" (q{d['question_id']} turn {d['turn'] + 1} @ {d['index']})"
    return text


def _revisions(report: dict) -> str:
    """The verispec commit each sitting ran, when recorded."""
    revs = [seg.get("revision") for seg in report.get("segments", [])] or [report["machine"].get("revision")]
    if not any(revs):
        return ""
    if len(set(revs)) == 1:
        return f"; verispec {revs[0]}"
    return "; verispec by sitting: " + ", ".join(r or "not recorded" for r in revs)


def render_markdown(report: dict) -> str:
    m, s, w = report["machine"], report["settings"], report["workload"]
    cats = [*w["categories"], OVERALL]
    lines = ["# verispec bench report", ""]
    if report["partial"]:
        lines += [f"**PARTIAL REPORT: interrupted after {report['blocks_done']} of {report['blocks_planned']} "
                  "(question, repeat) blocks.**", ""]
    lines += [
        f"- command: `{report['command']}`",
        f"- date: {m['date']}; machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads, "
        f"torch {m['torch']}, transformers {m['transformers']}"
        + (f", GPU {m['cuda']}" if m.get("cuda") else "")
        + f"; load average {_f(m['loadavg_start'])} at start, {_f(m.get('loadavg_end'))} at end",
        f"- model: {report['model']} ({report['dtype']}"
        + (f", {report['quantization']} weights" if report.get("quantization", "none") != "none" else "")
        + f"); T = {s['temperature']:g}; "
        + (f"top-p {s['top_p']:g}; " if s.get("top_p") else "")
        + f"up to {s['max_tokens']} tokens "
        f"per turn; {s['repeats']} repeat(s); "
        + (f"first {s['max_turns']} turn(s) of each question; " if s.get("max_turns") else "")
        + f"workload {w['name']}: "
        + ", ".join(f"{c} {sum(1 for q in w['questions'] if q['category'] == c)}" for c in w["categories"])
        + f" questions; wall time {report['wall_s'] / 60:.1f} min"
        + (f" in {len(report['segments'])} sittings (resumed with --resume; each question block ran whole, "
           "all methods side by side, within one sitting)" if len(report.get("segments", [])) > 1 else "")
        + _revisions(report),
        "",
    ]
    for label, stale in (report.get("stale_caches") or {}).items():
        lines += [f"**WARNING: {label} reported {stale['excess_tokens']} cached prompt tokens in {stale['turns']} "
                  f"turn(s) (of {stale['prompt_tokens']} prompt tokens) that this run's own requests do not explain: it kept "
                  "K/V from before the run and skipped prefill work, so its figures are not a fresh server's. "
                  "Restart it before each run.**", ""]
    lines += [
        "## Speedup over verispec plain (end to end tok/s ratio)",
        "",
        "| method | " + " | ".join(cats) + " |",
        "|---|" + "---:|" * len(cats),
    ]
    for label, by_cat in report["results"].items():
        cells = [f"{_f(by_cat[c]['speedup'])}x" if c in by_cat else "-" for c in cats]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "", "## Details", "",
        "| method | category | tok/s | speedup | decode tok/s | decode speedup | prompt s | mean acc len "
        "| acc rate | per-position acc | draft / verify share | c | alpha | identical to plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for label, by_cat in report["results"].items():
        for c in cats:
            if c not in by_cat:
                continue
            f = by_cat[c]
            pos = " ".join(f"{a:.2f}" for a in f["per_position_acceptance"] or []) or "-"
            share = "n/a" if f["draft_share"] is None else f"{f['draft_share']:.0%} / {f['verify_share']:.0%}"
            prompt = f["total_s"] - f["decode_s"]  # the turns' prompt prefill (and time to first token)
            lines.append(
                f"| {label} | {c} | {_f(f['tok_s'])} | {_f(f['speedup'])}x | {_f(f['decode_tok_s'])} | "
                f"{_f(f['decode_speedup'])}x | {_f(prompt, '.1f')} | {_f(f['mean_acceptance_length'])} | "
                f"{_f(f['acceptance_rate'])} | "
                f"{pos} | {share} | {_f(f['c'], '.3f')} | {_f(f['alpha'], '.3f')} | {_identical(f)} |")
    if any(m["backend"] != "verispec" for m in report["methods"]):
        lines += ["", "transformers, llama.cpp and other servers compute with other kernels than verispec, so at "
                  "T = 0 their answers may part from verispec plain's after a near tie in the logits; the identity "
                  "column reports it as measured (an openai:* server's answer is compared as its text re-tokenized)."]
    for a in report["goals"].get("adaptive_vs_fixed", []):
        lines += ["", f"## Adaptive against fixed k: {a['family']}", "",
                  f"{a['adaptive']} against the best of {', '.join(a['fixed'])} in each category (end to end "
                  "speedups over plain).", "",
                  "| category | adaptive | best fixed | its speedup | adaptive / best fixed |", "|---|---:|---|---:|---:|"]
        lines += [f"| {c} | {_f(p['adaptive'])}x | {p['best_fixed']} | {_f(p['best_fixed_speedup'])}x | "
                  f"{_f(p['vs_best'])} |" for c, p in a["per_category"].items()]
    lines += ["", "## Goals", ""] + _goal_lines(report["goals"])
    peers = report["goals"].get("vs_peers") or []
    if peers:
        lines += ["", "## Against the other engines", "",
                  f"verispec's fastest method overall ({peers[0]['ours']}) over each other engine's method: end to "
                  "end tok/s ratios, per category and overall.", "",
                  "| other engine | " + " | ".join(cats) + " | lowest |", "|---|" + "---:|" * (len(cats) + 1)]
        lines += [f"| {p['peer']} | " + " | ".join(_times(p["per_category"].get(c)) for c in cats)
                  + f" | {p['lowest_category'] or '-'} {_times(p['lowest'])} |" for p in peers]
    d = report.get("drift") or {}
    if d.get("blocks"):
        adjusted = [(label, by_cat) for label, by_cat in report["results"].items()
                    if any(f.get("speed_adjusted_speedup") is not None for f in by_cat.values())]
        lines += ["", "## Machine drift", "",
                  f"Within a question block, the plain decode step T(1) that the runs measured themselves "
                  f"differed by {_f(d['t1_spread_median'])}x between the slowest and the fastest run (median "
                  f"over {d['blocks']} blocks; largest {_f(d['t1_spread_max'])}x). Speedups counted in each "
                  "run's own decode steps, where every run of a method measured T(1) (so the drift cancels):",
                  "", "| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
        lines += [f"| {label} | " + " | ".join(_times(by_cat[c].get("speed_adjusted_speedup")) if c in by_cat else "-"
                                               for c in cats) + " |"
                  for label, by_cat in adjusted]
    per_repeat = [f"{label} " + " / ".join(_f(v) for v in by_cat[OVERALL]["tok_s_by_repeat"])
                  for label, by_cat in report["results"].items() if OVERALL in by_cat]
    if s["repeats"] > 1:
        lines += ["", "Overall tok/s per repeat (drift): " + "; ".join(per_repeat)]
    return "\n".join(lines) + "\n"


def _status(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


def _goal(g: dict) -> str:
    """`` (goal >= 2.0x: met)``, or nothing for a ratio that was not held to a goal."""
    return "" if g["goal"] is None else f" (goal >= {g['goal']}x: {_status(g['met'])})"


def _adaptive_line(a: dict) -> str:
    within, over, plain = a["within_best"], a["over_best_overall"], a["vs_plain"]
    if within["goal"] is None:
        first = f"lowest {_f(within.get('lowest'))}x the best fixed k in a category"
    else:
        first = (f"within {1 - within['goal']:.0%} of the best fixed k in every category "
                 f"({_status(within['met'])})")
    return (f"- {a['adaptive']}: {first}; overall {_f(over['ratio'])}x the best fixed k{_goal(over)}; lowest "
            f"{_f(plain['lowest'])}x plain in a category{_goal(plain)}")


def _goal_lines(g: dict) -> list[str]:
    a, p, t = g["best_verispec_vs_hf_assisted"], g["verispec_plain_vs_hf_plain"], g["verispec_t0_identical"]
    hf = []  # only when transformers ran
    if a["theirs"] is not None:
        hf.append(f"- best verispec method vs hf:assisted: {a['ours'] or '-'} / {a['theirs']} = {_f(a['ratio'])}x"
                  + _goal(a))
    if p["theirs"] is not None:
        hf.append(f"- verispec plain vs hf:plain: {_f(p['ratio'])}x" + _goal(p))
    return hf + [
        f"- verispec answers identical to plain at T = 0: {t['identical']}/{t['compared']} ({_status(t['met'])})",
    ] + [_adaptive_line(a) for a in g.get("adaptive_vs_fixed", [])]


def summary_json(report: dict) -> str:
    """The report without its per-run records, as one line."""
    return json.dumps({k: v for k, v in report.items() if k != "runs"})


def write_report(report: dict, out: Path, plots: bool = True) -> list[Path]:
    """report.json and report.md (each replaced whole, so a run killed while writing leaves the
    previous one), and the two plots unless ``plots`` is false (a checkpoint)."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.json", out / "report.md"]
    md = render_markdown(report) + "\n![speedup](speedup.png)\n\n![acceptance by position](acceptance.png)\n"
    for path, text in zip(files, (json.dumps(report, indent=1) + "\n", md)):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    if plots:
        files += [out / "speedup.png", out / "acceptance.png"]
        plot_speedup(report, files[2])
        plot_acceptance(report, files[3])
    return files


# ---------------------------------------------------------------------------------------------
# --compare
# ---------------------------------------------------------------------------------------------


def load_report(path: Path) -> dict:
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no such report: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON report ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), dict):
        raise ValueError(f"{path} is not a verispec bench report (no 'results')")
    return report


# ---------------------------------------------------------------------------------------------
# --resume
# ---------------------------------------------------------------------------------------------

# What must match for an earlier report's blocks to be reused: the same model and weights, the
# same methods, settings and questions.
RESUME_KEYS = ("model", "dtype", "quantization", "methods", "settings")
# ... and the same kind of machine: blocks timed on another CPU or software stack are not
# comparable with the ones still to run.
RESUME_MACHINE_KEYS = ("cpu", "cpu_count", "torch_threads", "torch", "transformers", "cuda")


def resume_runs(previous: dict, current: dict) -> list[Run]:
    """The runs of ``previous`` (a report read back), checked against ``current`` (the same keys
    of the run about to start); a mismatch is an error that names what differs."""
    for key in RESUME_KEYS:
        if previous.get(key) != current.get(key):
            raise ValueError(f"cannot resume: {key} differs from the earlier report's "
                             f"({previous.get(key)!r} there, {current.get(key)!r} now)")
    before, now = previous.get("machine", {}), current.get("machine", {})
    for key in RESUME_MACHINE_KEYS:
        if before.get(key) != now.get(key):
            raise ValueError(f"cannot resume on another machine: {key} is {now.get(key)!r} here, "
                             f"{before.get(key)!r} in the earlier report; start a new report instead")
    planned = {(q["question_id"], q["category"]) for q in current["workload"]["questions"]}
    runs = []
    for r in previous.get("runs", []):
        if (r["question_id"], r["category"]) not in planned:
            raise ValueError(f"cannot resume: the earlier report ran question {r['question_id']!r}, "
                             "which is not in this run's questions")
        if "metrics" not in r:
            raise ValueError("cannot resume: the earlier report does not keep its runs' metrics "
                             "(written by an older verispec)")
        result = TurnResult(r["output_ids"], r["total_s"], r["prefill_s"], r["finish_reason"],
                            SpecMetrics.from_dict(r["metrics"]) if r["metrics"] else None, r["first_tokens"],
                            r.get("cached_prompt_tokens"))
        runs.append(Run(r["method"], r["question_id"], r["category"], r["turn"], r["repeat"], r["order"],
                        r["prompt_tokens"], result, r.get("reusable_prompt_tokens")))
    return runs


def compare_reports(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """A Markdown diff of two reports: tok/s and speedup per method and category."""
    lines = [f"# verispec bench: {name_a} (A) vs {name_b} (B)", ""]
    for key in ("model", "dtype"):
        if a.get(key) != b.get(key):
            lines.append(f"- note: {key} differs: A {a.get(key)}, B {b.get(key)}")
    wa, wb = (r.get("workload", {}) for r in (a, b))
    if (wa.get("name"), wa.get("questions")) != (wb.get("name"), wb.get("questions")):
        lines.append(f"- note: the questions differ: A {wa.get('name')}, B {wb.get('name')}")
    if a.get("settings") != b.get("settings"):
        lines.append(f"- note: settings differ: A {a.get('settings')}, B {b.get('settings')}")
    for rep, name in ((a, "A"), (b, "B")):
        if rep.get("partial"):
            lines.append(f"- note: report {name} is partial")
    lines += ["", "| method | category | tok/s A | tok/s B | change | speedup A | speedup B | change |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    only: list[str] = []
    for label in dict.fromkeys([*a["results"], *b["results"]]):
        ra, rb = a["results"].get(label), b["results"].get(label)
        if ra is None or rb is None:
            only.append(f"{label} (only in {'B' if ra is None else 'A'})")
            continue
        for cat in dict.fromkeys([*ra, *rb]):
            fa, fb = ra.get(cat), rb.get(cat)
            if fa is None or fb is None:
                only.append(f"{label} / {cat} (only in {'B' if fa is None else 'A'})")
                continue
            rel = _ratio(fb["tok_s"], fa["tok_s"])
            delta = None if fa["speedup"] is None or fb["speedup"] is None else fb["speedup"] - fa["speedup"]
            lines.append(f"| {label} | {cat} | {_f(fa['tok_s'])} | {_f(fb['tok_s'])} | "
                         f"{'n/a' if rel is None else format(rel - 1, '+.1%')} | {_f(fa['speedup'])}x | "
                         f"{_f(fb['speedup'])}x | {'n/a' if delta is None else format(delta, '+.2f')} |")
    if only:
        lines += ["", "Not in both: " + "; ".join(only)]
    return "\n".join(lines) + "\n"
