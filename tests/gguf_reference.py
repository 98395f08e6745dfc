"""transformers' own implementation holding a GGUF file's weights, as verispec reads them.

The model class comes from the configuration verispec reads from the file's metadata and the
weights from :class:`~verispec.models.gguf_convert.GGUFTensors` (gguf's float32 dequantization,
under Hugging Face names): the reference for verispec's dense float32 load on the same weights,
where the two differ only in float32 summation order. :func:`write_bare_gguf` writes a file of
any architecture with nothing but a zero embedding table, for tests of what is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def write_bare_gguf(path: Path, arch: str, width: int) -> Path:
    """A GGUF file of architecture ``arch``: one block, an 8 x ``width`` float32 embedding of
    zeros, nothing else (enough for a loader to refuse it)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, width), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
