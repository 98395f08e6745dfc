"""``verispec bench``: a Spec-Bench-style harness with peer baselines and an equality check.

Layers, each usable on its own:

* :mod:`~verispec.bench.workloads` -- questions (Spec-Bench's file, a user's JSONL, the built-in
  code-editing set), category selection and the chat prompts of each turn;
* :mod:`~verispec.bench.methods` -- ``--methods`` parsing and one runner per method: verispec's
  engine (plain or any registered drafter), transformers ``generate`` (plain, assisted, prompt
  lookup) and llama.cpp;
* :mod:`~verispec.bench.runner` -- the interleaved loop over questions, repeats and methods;
* :mod:`~verispec.bench.report` and :mod:`~verispec.bench.plots` -- figures, the T = 0
  equality check, report.json / report.md / PNGs, and ``--compare``;
* :mod:`~verispec.bench.cli` -- the ``verispec bench`` subcommand.
"""
