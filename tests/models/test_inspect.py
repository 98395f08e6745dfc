"""`verispec models inspect`: a GGUF file's facts and routes, read from its header alone.

Tiny GGUF files are written with ``gguf.GGUFWriter`` (the contents of the tensors do not matter:
inspection reads the header only). Every figure asserted is derived from the shapes and types
written here, not copied from the report.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from verispec import cli
from verispec.models.errors import CorruptGGUFError
from verispec.models.inspect import format_inspection, inspect_gguf

HIDDEN, FF, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 256, 4, 2, 2, 96
UNRUN = GGMLQuantizationType.IQ2_XXS  # an i-quant the kernels do not run


def _raw(qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


def _write(path: Path, arch: str = "llama", down_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_name("inspect test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    q8 = GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", _raw(q8, VOCAB, HIDDEN), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN), "ffn_down": (HIDDEN, FF)}  # fmt: skip
        for kind, (n, k) in shapes.items():
            qtype = down_type if kind == "ffn_down" else q8
            writer.add_tensor(f"blk.{i}.{kind}.weight", _raw(qtype, n, k), raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _q8_bytes(n: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    return n * k // block * size


def test_every_linear_layer_on_the_kernels(tmp_path: Path) -> None:
    r = inspect_gguf(_write(tmp_path / "m.gguf"))
    assert r.runs is None and r.architecture == "llama" and r.name == "inspect test"
    assert (r.layers, r.hidden, r.ffn, r.heads, r.kv_heads, r.head_dim, r.vocab, r.context_length) == (
        LAYERS, HIDDEN, FF, HEADS, KV_HEADS, HIDDEN // HEADS, VOCAB, 2048)
    assert r.dense_layers == 0
    q8 = next(t for t in r.types if t.type_name == "Q8_0")
    assert q8.tensors == 1 + 7 * LAYERS
    assert q8.routes == {"embedding table (read from the file) and LM head": 1, "native kernels": 7 * LAYERS}
    f32 = next(t for t in r.types if t.type_name == "F32")
    assert f32.tensors == 1 + 2 * LAYERS and f32.params == HIDDEN * (1 + 2 * LAYERS)
    # memory: the layers' blocks, the tied head's blocks, float32 vectors (the table stays in the file)
    head_dim = HIDDEN // HEADS
    layer_bytes = sum(_q8_bytes(n, k) for n, k in [(HIDDEN, HIDDEN), (KV_HEADS * head_dim, HIDDEN),
                                                   (KV_HEADS * head_dim, HIDDEN), (HIDDEN, HIDDEN),
                                                   (FF, HIDDEN), (FF, HIDDEN), (HIDDEN, FF)])
    expected = LAYERS * layer_bytes + _q8_bytes(VOCAB, HIDDEN) + 4 * f32.params
    assert r.weights_bytes == expected
    assert r.kv_bytes_per_token == 2 * LAYERS * KV_HEADS * head_dim * 2
    text = format_inspection(r, context=100)
    assert "runs (as LlamaForCausalLM)" in text and "fallback      none" in text
    assert "at 100 tokens" in text


def test_a_type_the_kernels_do_not_run_is_named_with_its_cost(tmp_path: Path) -> None:
    r = inspect_gguf(_write(tmp_path / "m.gguf", down_type=UNRUN))
    assert r.dense_layers == LAYERS
    assert r.dense_reasons == {f"{UNRUN.name} is not run by the kernels": LAYERS}
    row = next(t for t in r.types if t.type_name == UNRUN.name)
    assert row.routes == {"dense float32 (fallback)": LAYERS}
    text = format_inspection(r)
    assert f"{LAYERS} linear tensor(s) run dense: {UNRUN.name} is not run by the kernels" in text
    assert "4 bytes a weight" in text


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32])
def test_float_linear_tensors_run_on_the_kernels(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    r = inspect_gguf(_write(tmp_path / "m.gguf", down_type=qtype))
    assert r.dense_layers == 0
    row = next(t for t in r.types if t.type_name == qtype.name)
    assert row.routes.get("native kernels") == LAYERS


def test_an_architecture_verispec_does_not_run_says_why(tmp_path: Path) -> None:
    r = inspect_gguf(_write(tmp_path / "m.gguf", arch="mamba"))
    assert r.runs is not None and "unsupported GGUF architecture 'mamba'" in r.runs
    assert "NOT RUN" in format_inspection(r)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "m.gguf")
    assert cli.main(["models", "inspect", str(path), "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "at 64 tokens" in out
    assert cli.main(["models", "inspect", str(path), "--context", "0"]) == 2
    assert "--context must be a positive" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(CorruptGGUFError):
        inspect_gguf(bad)
    assert cli.main(["models", "inspect", str(bad)]) == 2
    assert "bad magic" in capsys.readouterr().err
