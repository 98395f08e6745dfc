"""An agent workload end to end: multi-turn tool calling with JSON arguments through the OpenAI
chat API, verispec (speculative and plain) against llama.cpp's ``llama-server --jinja``.

The workload (``data/agent.jsonl``, written for this benchmark and never used to tune anything)
is 24 conversations with a coding agent's tools (read, write and search files of a small
project, run its tests) and an assistant's (weather, currency, orders, calendar, SQL, stock
prices). Each user turn says how many tool-call requests it takes: each such request is sent
with ``tool_choice: "required"`` and ``parallel_tool_calls: false``, so the answer is one call
whose arguments follow the function's JSON schema; the benchmark runs the calls with deterministic fake tools (:class:`Workspace`) and
sends their results back as ``tool`` messages. The turn ends with an answer: plain text
(``tool_choice: "none"``), or JSON under a ``json_schema`` response format where the turn gives
one. Conversations grow to a few thousand tokens (file contents come back in tool results and
go out again in written files), which is where drafting from the conversation pays.

Every method is a server on this machine, asked the same way through the ``openai`` client,
non-streamed, greedy:

* ``verispec`` -- this process serves the target with the drafter ``--speculative-config``
  (default: what ``verispec serve`` runs with no flag) and, from a second engine on the same
  weights, ``verispec-plain`` (no drafter);
* ``llama-<mode>`` -- one ``llama-server --jinja`` per mode of ``--llama-modes`` (plain,
  ``ngram-mod``, the draft model), started from ``--llama-bin`` on the same GGUF file with the
  same threads and context, each idle while the others run. llama-server does not hold
  ``tool_choice: "required"`` to a call for every template (Qwen2.5's answers in free text), so
  its call requests carry the call's JSON schema as their response format instead (see
  :func:`run_conversation`).

For each conversation the methods run in turn, the first one rotating from conversation to
conversation, so machine drift hits them alike. A method's figure is its completion tokens
over its wall time, every request of every conversation included (prompts too: that is the end
to end time of the agent's loop); the conversations' wall times are summed as well, and the
quickest llama-server mode's time over verispec's is reported beside the judged ratio. Methods
write different tokens once their outputs differ, so tokens per second compares them.

Checked: each verispec conversation's calls and answers equal verispec-plain's, and every call's
arguments and every constrained answer parse as JSON that validates against its schema
(requests cut by ``max_tokens`` are counted apart). Goals: verispec's tokens/s over the best
llama-server mode's (``--goal-vs-llama``), every output identical, every constrained output
valid. A Markdown table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verispec.bench.goals import judged
from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import DRAFT, TARGET, PresetParser, emit_report, goal_status, number
from verispec.bench.workloads import CODE_BODIES

WORKLOAD = Path(__file__).resolve().parent.parent / "data" / "agent.jsonl"

# llama-server's modes: extra arguments ({draft}: the draft model's GGUF file)
LLAMA_MODES = {
    "plain": [],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "draft": ["--spec-type", "draft-simple", "-md", "{draft}", "--spec-draft-n-max", "8"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from verispec.config import DEFAULT_SPECULATIVE

    p = PresetParser("agent", __doc__, target=TARGET, speculative_config=json.dumps(DEFAULT_SPECULATIVE), threads=2,
                     max_model_len=8192, out=None)
    p.add_argument("--draft", default=DRAFT, help="llama-server's draft model, bundled name or GGUF file "
                                                  "(default: %(default)s)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="directory holding llama-server (default: none, verispec only)")
    p.add_argument("--llama-modes", default="plain,ngram-mod,draft",
                   help=f"llama-server modes, of {', '.join(LLAMA_MODES)} (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=None, help="the first N conversations (default: all)")
    p.add_argument("--max-call-tokens", type=int, default=512, help="max_tokens of a tool-call request")
    p.add_argument("--max-answer-tokens", type=int, default=256, help="max_tokens of an answer")
    p.add_goal("vs-llama", 2.0, "verispec's tokens/s over the best llama-server mode's")
    args = p.parse_args(argv)
    modes = [m for m in args.llama_modes.split(",") if m]
    unknown = [m for m in modes if m not in LLAMA_MODES]
    if unknown:
        p.error(f"unknown --llama-modes {', '.join(unknown)}; valid: {', '.join(LLAMA_MODES)}")
    args.llama_modes = modes if args.llama_bin else []
    if args.llama_bin and not (args.llama_bin / "llama-server").is_file():
        p.error(f"{args.llama_bin} holds no llama-server")
    return args


def conversations(limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in WORKLOAD.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit]


# -------------------------------------------------------------------------------------- the tools

def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


_STR = {"type": "string"}
TOOLS: dict[str, dict] = {
    "read_file": {"description": "Read a file of the project.", "parameters": _object({"path": _STR})},
    "write_file": {"description": "Write a file of the project, replacing its whole content.",
                   "parameters": _object({"path": _STR, "content": _STR})},
    "run_tests": {"description": "Run the tests of a file of the project.", "parameters": _object({"path": _STR})},
    "search_code": {"description": "Search the project's files for a text; returns matching lines.",
                    "parameters": _object({"query": _STR})},
    "get_weather": {"description": "The current weather in a city.",
                    "parameters": _object({"city": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})},
    "convert_currency": {"description": "Convert an amount of money between currencies (ISO codes).",
                         "parameters": _object({"amount": {"type": "number"}, "source": _STR, "target": _STR})},
    "lookup_order": {"description": "Look up an order by its id.", "parameters": _object({"order_id": _STR})},
    "update_order": {"description": "Set the status of an order.",
                     "parameters": _object({"order_id": _STR, "status": {
                         "type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]}})},
    "list_events": {"description": "The calendar's events on a date (YYYY-MM-DD).", "parameters": _object({"date": _STR})},
    "create_event": {"description": "Add an event to the calendar.",
                     "parameters": _object({"title": _STR, "date": _STR, "start": _STR,
                                            "duration_minutes": {"type": "integer"}})},
    "run_sql": {"description": "Run a read-only SQL query on the shop's database.", "parameters": _object({"query": _STR})},
    "get_stock_price": {"description": "The latest price of a stock, in USD.", "parameters": _object({"symbol": _STR})},
}

PROJECT = {
    "utils/stats.py": CODE_BODIES[0] + "\n",
    "inventory.py": CODE_BODIES[1].split("\n\n    def total")[0] + "\n",  # without its total()
    "net/parser.py": '''def parse_header(line):
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def parse_headers(text):
    headers = {}
    for line in text.splitlines():
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
''',
    "config/loader.py": '''import json


def load_config(path):
    with open(path) as f:
        return json.load(f)


def get_setting(config, key, default=None):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
''',
    "utils/text.py": '''def truncate(text, width):
    if len(text) <= width:
        return text
    return text[: width - 3] + "..."


def word_count(text):
    # TODO: count words separated by any whitespace, not only spaces
    return len(text.split(" "))
''',
    "tests/test_stats.py": '''from utils.stats import moving_average, normalize


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]


def test_normalize():
    assert normalize([2, 4, 6]) == [0.0, 0.5, 1.0]
''',
    "tests/test_inventory.py": '''import pytest

from inventory import Inventory


def test_add_and_remove():
    inv = Inventory()
    inv.add("apple", 3)
    inv.remove("apple", 1)
    assert inv.items == {"apple": 2}


def test_remove_too_many():
    inv = Inventory()
    with pytest.raises(KeyError):
        inv.remove("pear", 1)
''',
}

USD_RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.2, "CHF": 0.88, "CAD": 1.36}
ORDERS = {
    "A-1042": {"status": "pending", "total": 129.90, "items": ["keyboard", "mouse"]},
    "B-2001": {"status": "shipped", "total": 59.00, "items": ["headphones"]},
    "B-2002": {"status": "pending", "total": 240.50, "items": ["monitor stand", "cable"]},
    "C-3310": {"status": "delivered", "total": 87.25, "items": ["desk lamp"]},
    "D-4417": {"status": "shipped", "total": 310.00, "items": ["office chair"]},
}


def _stable_number(text: str, low: float, high: float) -> float:
    """A stable number in [low, high) for ``text``."""
    return round(low + (zlib.crc32(text.strip().lower().encode()) % 10_000) / 10_000 * (high - low), 2)


class Workspace:
    """One conversation's fake world: the project's files, the orders and the calendar, changed
    by the calls that write. Every result is a function of the calls made so far."""

    def __init__(self) -> None:
        self.files = dict(PROJECT)
        self.orders = {k: dict(v) for k, v in ORDERS.items()}
        self.events: list[dict] = [{"title": "Standup", "date": "2026-03-14", "start": "09:30", "duration_minutes": 15}]

    def call(self, name: str, args: dict) -> str:
        return json.dumps(getattr(self, name)(**args))

    def read_file(self, path: str) -> Any:
        if path in self.files:
            return {"path": path, "content": self.files[path]}
        return {"error": f"no such file: {path}", "files": sorted(self.files)}

    def write_file(self, path: str, content: str) -> Any:
        self.files[path] = content
        return {"path": path, "written_characters": len(content)}

    def run_tests(self, path: str) -> Any:
        if path not in self.files:
            return {"error": f"no such file: {path}", "files": sorted(self.files)}
        tested = [path] + [p for p in self.files if p.startswith("tests/") and Path(path).stem in p]
        for p in tested:
            try:
                compile(self.files[p], p, "exec")
            except SyntaxError as e:
                return {"passed": 0, "failed": 1, "error": f"{p}:{e.lineno}: SyntaxError: {e.msg}"}
        count = sum(self.files[p].count("def test_") for p in tested)
        return {"passed": max(count, 1), "failed": 0}

    def search_code(self, query: str) -> Any:
        hits = [f"{p}:{i}: {line.strip()}" for p, text in sorted(self.files.items())
                for i, line in enumerate(text.splitlines(), 1) if query.lower() in line.lower()]
        return {"matches": hits[:10]}

    def get_weather(self, city: str, unit: str) -> Any:
        celsius = _stable_number(city, -5, 32)
        value = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32, 1)
        sky = ("sunny", "cloudy", "light rain", "windy")[zlib.crc32(city.lower().encode()) % 4]
        return {"city": city, "temperature": value, "unit": unit, "conditions": sky}

    def convert_currency(self, amount: float, source: str, target: str) -> Any:
        rates = [USD_RATES.get(c.upper()) for c in (source, target)]
        if None in rates:
            return {"error": "unknown currency", "known": sorted(USD_RATES)}
        return {"amount": round(amount / rates[0] * rates[1], 2), "currency": target.upper()}

    def lookup_order(self, order_id: str) -> Any:
        order = self.orders.get(order_id.upper())
        return {"order_id": order_id.upper(), **order} if order else {"error": f"no order {order_id}"}

    def update_order(self, order_id: str, status: str) -> Any:
        order = self.orders.get(order_id.upper())
        if order is None:
            return {"error": f"no order {order_id}"}
        order["status"] = status
        return {"order_id": order_id.upper(), **order}

    def list_events(self, date: str) -> Any:
        return {"date": date, "events": [e for e in self.events if e["date"] == date]}

    def create_event(self, title: str, date: str, start: str, duration_minutes: int) -> Any:
        event = {"title": title, "date": date, "start": start, "duration_minutes": duration_minutes}
        self.events.append(event)
        return {"created": event}

    def run_sql(self, query: str) -> Any:
        q = query.lower()
        if "count(" in q or "avg(" in q or "sum(" in q or "max(" in q:
            return {"columns": ["value"], "rows": [[_stable_number(query, 10, 5000)]]}
        if "users" in q:
            return {"columns": ["id", "email", "created_at"],
                    "rows": [[900 - i, f"user{900 - i}@example.com", f"2025-12-{28 - i:02d}"] for i in range(10)]}
        return {"columns": ["id", "status", "total"],
                "rows": [[k, v["status"], v["total"]] for k, v in ORDERS.items()]}

    def get_stock_price(self, symbol: str) -> Any:
        return {"symbol": symbol.upper(), "price_usd": _stable_number(symbol, 20, 400)}


def valid(text: str | None, schema: dict) -> tuple[bool, Any]:
    """Whether ``text`` is JSON that validates against ``schema``, and the value."""
    import jsonschema

    try:
        value = json.loads(text or "")
        jsonschema.validate(value, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False, None
    return True, value


# -------------------------------------------------------------------------------- one conversation

def _calls_from_schema_answer(choice: Any, calls_so_far: int) -> list:
    """The one call an answer under the call's JSON schema holds (none where it is not JSON)."""
    try:
        value = json.loads(choice.message.content or "")
        call = SimpleNamespace(id=f"call-{calls_so_far}", function=SimpleNamespace(
            name=value["name"], arguments=json.dumps(value["arguments"])))
    except (json.JSONDecodeError, KeyError, TypeError):
        return []
    return [call]


def run_conversation(client: Any, conv: dict, max_call_tokens: int, max_answer_tokens: int,
                     calls_by_schema: bool = False) -> dict:
    """The conversation against one server: what the model produced (calls and answers), the
    completion tokens, requests, wall time, and the constrained outputs' validity.

    ``calls_by_schema``: for a server that does not hold ``tool_choice: "required"`` to a call
    (llama-server with some templates answers in free text), each call request carries the
    call's JSON schema (a name and its arguments) as its response format instead, and the call
    is read from the answer's JSON; the prompt is the same, the tools included."""
    from verispec.tools import call_schema

    tools = [{"type": "function", "function": {"name": n, **TOOLS[n]}} for n in conv["tools"]]
    # one call per request, as the schema form below makes (with parallel calls a model that has
    # not seen the first call's result yet goes on to guess at the next one's arguments)
    forced: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    if calls_by_schema:
        schema = {k: v for k, v in call_schema(tools).items() if k != "x-guidance"}
        forced = {"response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}}
    world = Workspace()
    messages: list[dict] = []
    produced: list[list] = []
    counts = {"tokens": 0, "requests": 0, "constrained": 0, "valid": 0, "cut": 0}

    def ask(**kwargs: Any) -> Any:
        r = client.chat.completions.create(model="bench", messages=messages, temperature=0.0, **kwargs)
        counts["tokens"] += r.usage.completion_tokens
        counts["requests"] += 1
        return r.choices[0]

    start = time.perf_counter()
    for turn in conv["turns"]:
        messages.append({"role": "user", "content": turn["user"]})
        for _ in range(turn["calls"]):
            choice = ask(tools=tools, max_tokens=max_call_tokens, **forced)
            calls = (_calls_from_schema_answer(choice, counts["requests"]) if calls_by_schema
                     else choice.message.tool_calls or [])
            if choice.finish_reason == "length":
                counts["cut"] += 1
                produced.append(["cut", choice.message.content])
                break  # the agent has no call to run
            counts["constrained"] += max(len(calls), 1)
            if not calls:
                produced.append(["no call", choice.message.content])
                messages.append({"role": "assistant", "content": choice.message.content or ""})
                continue
            messages.append({"role": "assistant", "content": choice.message.content or "", "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in calls]})
            for c in calls:
                produced.append(["call", c.function.name, c.function.arguments])
                schema = TOOLS.get(c.function.name, {}).get("parameters")
                ok, args = valid(c.function.arguments, schema) if schema else (False, None)
                counts["valid"] += ok
                result = world.call(c.function.name, args) if ok else json.dumps({"error": "invalid call"})
                messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        if "answer_schema" in turn:
            choice = ask(max_tokens=max_answer_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": turn["answer_schema"], "strict": True}})
            if choice.finish_reason == "length":
                counts["cut"] += 1
            else:
                counts["constrained"] += 1
                counts["valid"] += valid(choice.message.content, turn["answer_schema"])[0]
        else:
            choice = ask(tools=tools, tool_choice="none", max_tokens=max_answer_tokens)
        text = choice.message.content or ""
        produced.append(["answer", text])
        messages.append({"role": "assistant", "content": text})
    return {"id": conv["id"], "wall_s": time.perf_counter() - start, "produced": produced, **counts}


# ----------------------------------------------------------------------------------------- servers

class LlamaServer:
    """``llama-server --jinja`` in one mode on a free local port, for as long as the context."""

    def __init__(self, args: argparse.Namespace, mode: str, gguf: Path, draft: Path) -> None:
        from verispec.server.serve import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = [a.format(draft=draft) for a in LLAMA_MODES[mode]]
        self.cmd = [str(args.llama_bin / "llama-server"), "-m", str(gguf), "--jinja", "-t", str(args.threads),
                    "-tb", str(args.threads), "-c", str(args.max_model_len), "-np", "1", "--port", str(self.port),
                    "--host", "127.0.0.1", "--no-webui", *extra]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        import urllib.request

        from verispec.runtime import foreign_env

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=foreign_env())
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise SystemExit(f"llama-server did not answer /health within 300 s: {' '.join(self.cmd)}")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def verispec_servers(args: argparse.Namespace) -> dict:
    from verispec.config import SpeculativeConfig
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app
    from verispec.server.serve import BackgroundServer

    target = load_model(args.target)
    args.speculative = json.loads(args.speculative_config)
    spec = SpeculativeConfig.from_dict(args.speculative)
    engines = {"verispec": Engine(target, spec, max_model_len=args.max_model_len),
               "verispec-plain": Engine(target, None, max_model_len=args.max_model_len)}
    return {name: BackgroundServer(build_app(e, "bench", request_timeout_s=None)) for name, e in engines.items()}


def main(argv: list[str] | None = None) -> int:
    import contextlib

    import openai
    import torch

    from verispec.models.registry import fetch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = machine_load(args.threads)
    convs = conversations(args.conversations)
    servers = verispec_servers(args)
    if args.llama_modes:
        gguf = Path(args.target) if Path(args.target).is_file() else fetch(args.target, progress=False)
        draft = Path(args.draft) if Path(args.draft).is_file() else fetch(args.draft, progress=False)
        servers.update({f"llama-{m}": LlamaServer(args, m, gguf, draft) for m in args.llama_modes})
    methods = list(servers)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, server in servers.items():
            stack.enter_context(server)
            clients[name] = stack.enter_context(
                openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600))
            clients[name].chat.completions.create(model="bench", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0.0)  # warm-up, untimed
        for i, conv in enumerate(convs):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for name in order:
                run = run_conversation(clients[name], conv, args.max_call_tokens, args.max_answer_tokens,
                                       calls_by_schema=name.startswith("llama-"))
                runs[name].append(run)
                log(f"{conv['id']} {name}: {run['tokens']} tokens in {run['wall_s']:.1f} s "
                    f"({run['requests']} requests)")
    return emit_report(summarise(args, runs, load), print_table, args.out)


def summarise(args: argparse.Namespace, runs: dict[str, list[dict]], load: float) -> dict:
    plain = {r["id"]: r["produced"] for r in runs["verispec-plain"]}
    rows = {}
    for name, rs in runs.items():
        wall = sum(r["wall_s"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        rows[name] = {
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "requests": sum(r["requests"] for r in rs),
            "constrained": sum(r["constrained"] for r in rs), "valid": sum(r["valid"] for r in rs),
            "cut": sum(r["cut"] for r in rs),
            "identical": sum(r["produced"] == plain[r["id"]] for r in rs) if name.startswith("verispec") else None,
        }
    for row in rows.values():
        row["vs_verispec_plain"] = (row["tokens_per_s"] / rows["verispec-plain"]["tokens_per_s"]
                                    if row["tokens_per_s"] and rows["verispec-plain"]["tokens_per_s"] else None)
    llama = {k: v for k, v in rows.items() if k.startswith("llama-")}
    best = max(llama, key=lambda k: llama[k]["tokens_per_s"] or 0) if llama else None
    ratio = rows["verispec"]["tokens_per_s"] / llama[best]["tokens_per_s"] if best else None
    ours = rows["verispec"]
    # the same conversations' time: what an agent's user waits for (the methods' answers differ
    # in length, a llama-server answer under a JSON schema being pretty-printed, for one)
    quickest = min(llama, key=lambda k: llama[k]["wall_s"]) if llama else None
    wall_ratio = llama[quickest]["wall_s"] / ours["wall_s"] if quickest else None
    goals = {
        "vs_best_llama_server": {"best": best, "ratio": ratio, **judged(ratio, args.goal_vs_llama),
                                 "quickest": quickest, "conversation_time_ratio": wall_ratio},
        "identical": {"identical": ours["identical"], "conversations": len(runs["verispec"]),
                      "met": ours["identical"] == len(runs["verispec"])},
        "schema_valid": {"valid": ours["valid"], "constrained": ours["constrained"], "cut": ours["cut"],
                         "met": ours["valid"] == ours["constrained"]},
    }
    return {"target": args.target, "speculative_config": args.speculative, "threads": args.threads,
            "conversations": len(runs["verispec"]), "load_before": load, "methods": rows, "goals": goals,
            "runs": runs}


def print_table(report: dict) -> None:
    print(f"\ntarget {report['target']}, speculative {json.dumps(report['speculative_config'])}, "
          f"threads {report['threads']}, {report['conversations']} conversations\n")
    print("| method | tokens | wall s | tokens/s | vs verispec plain | requests | valid JSON | cut | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in report["methods"].items():
        ident = "" if m["identical"] is None else f"{m['identical']}/{report['conversations']}"
        print(f"| {name} | {m['tokens']} | {number(m['wall_s'], '.1f')} | {number(m['tokens_per_s'])} | "
              f"{number(m['vs_verispec_plain'])}x | {m['requests']} | {m['valid']}/{m['constrained']} | {m['cut']} | {ident} |")
    g = report["goals"]
    vs = g["vs_best_llama_server"]
    print(f"\ngoals: verispec over the best llama-server mode ({vs['best']}) {number(vs['ratio'])}x tokens/s "
          f"(goal >= {vs['goal']}x: {goal_status(vs['met'])}; the conversations' time: {number(vs['conversation_time_ratio'])}x "
          f"the quickest mode's, {vs['quickest']}); identical to plain {g['identical']['identical']}/"
          f"{g['identical']['conversations']} ({goal_status(g['identical']['met'])}); schema-valid "
          f"{g['schema_valid']['valid']}/{g['schema_valid']['constrained']} ({goal_status(g['schema_valid']['met'])})\n")


if __name__ == "__main__":
    sys.exit(main())
