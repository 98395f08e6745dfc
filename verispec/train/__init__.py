"""Training speculative heads on a target's own answers and features (``verispec train-drafter``).

This package sits above the engine, which answers the training prompts, and above the drafters,
whose heads it trains and writes; nothing under :mod:`verispec.speculative` imports it.

* :mod:`~verispec.train.data`: token rows (self-distilled answers, text windows), the draft
  vocabulary, the target's features, the on-disk caches.
* :mod:`~verispec.train.losses`: Medusa's loss and EAGLE-3's training-time test.
* :mod:`~verispec.train.drafter`: the command: training loop, checkpoints, held-out acceptance.
"""
