"""verispec: LLM inference built around lossless speculative decoding."""

__version__ = "0.1.0"
