"""``verispec bench``: a Spec-Bench-style harness with peer baselines and an equality check.

Layers, each usable on its own:

* :mod:`~verispec.bench.workloads` -- questions (Spec-Bench's file, a user's JSONL, the built-in
  code-editing set), category selection and the chat prompts of each turn;
* :mod:`~verispec.bench.methods` -- ``--methods`` parsing and one runner per method: verispec's
  engine (plain or any registered drafter), transformers ``generate`` (plain, assisted, prompt
  lookup) and llama.cpp;
* :mod:`~verispec.bench.runner` -- the interleaved loop over questions, repeats and methods;
* :mod:`~verispec.bench.report` and :mod:`~verispec.bench.plots` -- figures, the T = 0
  equality check, report.json / report.md / PNGs, and ``--compare``; :mod:`~verispec.bench.goals`
  -- what a report holds its ratios to, given by the caller;
* :mod:`~verispec.bench.harness` -- the general harness's options and run, from loading the
  target to the report;
* :mod:`~verispec.bench.presets` -- one module per preset benchmark, on the harness or with its
  own loop;
* :mod:`~verispec.bench.cli` -- the ``verispec bench`` subcommand: the harness and the presets.

Imports run one way, up this list: cli uses the presets and the harness, a preset the harness,
the harness the layers before it, and none of them anything after it.
"""
