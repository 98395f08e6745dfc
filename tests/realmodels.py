"""Prompts and settings shared by the real-model identity tests (fixtures in ``conftest.py``).

Plain greedy outputs of the Qwen2.5-Coder-1.5B target are computed once per test session
(``qwen_plain``), so every speculative method's identity test compares against the same
reference without paying for plain decoding again.
"""

from __future__ import annotations

from verispec.config import SamplingParams

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences: The quick brown fox jumps over the lazy dog. The dog did not "
    "react. The fox jumped again, and the dog finally woke up and chased the fox away.",
    "Explain what a hash map is and give a short example in Python.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
# A few lines of train-drafter data (self-distilled prompts, chat messages, plain text).
TRAIN_DRAFTER_LINES = [
    {"prompt": "Write a Python function that adds two numbers."},
    {"messages": [{"role": "user", "content": "List three primary colours."}]},
    {"prompt": "Explain recursion in one sentence."},
    {"text": "def square(x):\n    return x * x\n\n" * 8},
]
MAX_MODEL_LEN = 1024


def prompt_ids(model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template(text)
