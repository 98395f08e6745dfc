"""OpenAI-compatible HTTP server over the batched engine (``verispec serve``)."""
