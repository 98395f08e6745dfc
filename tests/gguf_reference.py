"""transformers' own implementation holding a GGUF file's weights, as verispec reads them.

The model class comes from the configuration verispec reads from the file's metadata and the
weights from :class:`~verispec.models.gguf_convert.GGUFTensors` (gguf's float32 dequantization,
under Hugging Face names): the reference for verispec's dense float32 load on the same weights,
where the two differ only in float32 summation order.
"""

from __future__ import annotations

import torch

from verispec.models.gguf_convert import GGUFTensors, metadata_dir, read_gguf_header


def transformers_on_the_file(loaded) -> torch.nn.Module:
    """transformers' model for ``loaded`` (a :class:`LoadedModel` of a GGUF file), float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = metadata_dir(loaded.source)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta), dtype=torch.float32).eval()
    tensors = GGUFTensors(read_gguf_header(loaded.source), meta)
    missing, unexpected = model.load_state_dict({name: tensors[name] for name in tensors}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model
