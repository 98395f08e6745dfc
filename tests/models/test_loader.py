"""Fast tests of the model loader and tokenizer wrapper, on tiny models built in the test.

* Hugging Face directories (Llama and Qwen2, tied and untied, single-file and sharded) are
  written with transformers and loaded with :func:`load_model`; float32 logits must match
  transformers within ``FP32_ATOL``.
* Tiny GGUF files are written with ``gguf.GGUFWriter``. Their float32 tensors hold values that
  are exact in bfloat16, so the conversion is lossless for them; one quantized (Q8_0) tensor per
  layer exercises dequantization. The converted weights must equal transformers' own GGUF
  reading (``load_gguf_checkpoint``) after bfloat16 rounding, which also checks that the
  Llama Q/K row permutation is undone.
* Every error path asserts on the message text.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from gguf_reference import write_bare_gguf
from verispec import kernels
from verispec.models import gguf_convert, loader
from verispec.models.decoder import UnsupportedModelError
from verispec.models.loader import (
    LoadedModel,
    ModelFileNotFoundError,
    ModelLoadError,
    converted_dir,
    load_model,
    metadata_dir,
    read_gguf_header,
)
from verispec.models.registry import bundled_path, is_fetched
from verispec.models.tokenizer import Tokenizer

FP32_ATOL = 1e-4  # native decoder vs transformers, float32, same weights
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = "hello world the a cat sat on mat user assistant system you are helpful what is".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads, and a private cache so conversions never touch the real one."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    torch.set_num_threads(2)


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models
# ---------------------------------------------------------------------------------------------


def _save_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)


def _tiny_hf(directory: Path, arch: str = "llama", tie: bool = False, shard: bool = False,
             seed: int = 0) -> torch.nn.Module:  # fmt: skip
    common = dict(
        vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(str(directory), max_shard_size="40KB" if shard else "1GB")
    _save_tokenizer(directory)
    return model


def _native_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    cache = loaded.model.new_cache(len(ids))
    return loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [1, 5, 9, 7, 12, 3, 18, 6, 2, 11, 4, 15]


@pytest.mark.parametrize(
    ("arch", "tie", "shard"),
    [("llama", False, False), ("llama", True, True), ("qwen2", True, False), ("qwen2", False, True)],
)
def test_hf_directory_matches_transformers(tmp_path: Path, arch: str, tie: bool, shard: bool) -> None:
    directory = tmp_path / f"tiny-{arch}"
    reference = _tiny_hf(directory, arch, tie, shard)
    if shard:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    loaded = load_model(directory, dtype="float32", progress=False)
    assert loaded.model.dtype == torch.float32
    assert loaded.source == directory and loaded.name == directory.name
    assert loaded.hf_config["architectures"] == [reference.config.architectures[0]]
    assert loaded.model.config.tie_word_embeddings is tie
    diff = (_native_logits(loaded, IDS) - _hf_logits(reference, IDS)).abs().max().item()
    assert diff < FP32_ATOL, f"max logit difference {diff:.3g}"


def test_auto_dtype_is_bfloat16_on_cpu(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    assert load_model(tmp_path / "m", progress=False).model.dtype == torch.bfloat16
    assert load_model(str(tmp_path / "m"), dtype="fp16", progress=False).model.dtype == torch.float16
    assert load_model(tmp_path / "m", dtype=torch.float32, progress=False).model.dtype == torch.float32


def test_kv_cache_dtype(tmp_path: Path) -> None:
    """A dense model's cache is in its own dtype unless asked; a bad choice fails before loading."""
    _tiny_hf(tmp_path / "m")
    assert load_model(tmp_path / "m", progress=False).model.new_cache(4).k[0].dtype == torch.bfloat16
    half = load_model(tmp_path / "m", dtype="float32", kv_cache_dtype="float16", progress=False).model
    assert half.new_cache(4).k[0].dtype == torch.float16
    with pytest.raises(ModelLoadError, match="kv_cache_dtype must be one of auto, float32, float16, got 'int8'"):
        load_model(tmp_path / "missing", kv_cache_dtype="int8", progress=False)


def test_tokenizer_wrapper(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    tok = load_model(tmp_path / "m", progress=False).tokenizer
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    assert tok.eos_token_ids == frozenset({vocab["</s>"], vocab["<|im_end|>"]})
    assert tok.vocab_size == len(vocab)
    assert tok.encode("hello world", add_special_tokens=False) == [vocab["hello"], vocab["world"]]
    assert tok.has_chat_template
    ids = tok.apply_chat_template("what is the cat", system="you are helpful")
    assert ids == tok.encode(
        "<|im_start|>system you are helpful<|im_end|> <|im_start|>user what is the cat<|im_end|> "
        "<|im_start|>assistant ",
        add_special_tokens=False,
    )
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert tok.render_chat(messages).startswith("<|im_start|>user hello<|im_end|> <|im_start|>assistant world")
    with pytest.raises(ValueError, match="both as `system` and as the first message"):
        tok.apply_chat_template([{"role": "system", "content": "a"}], system="b")
    words = "system you are helpful user what is the cat assistant".split()
    assert tok.decode(ids, skip_special_tokens=True).split() == words


def test_chat_template_in_a_separate_jinja_file(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = Tokenizer.from_pretrained(tmp_path / "m")
    assert tok.render_chat("hello") == "<|im_start|>user hello<|im_end|> <|im_start|>assistant "


def test_missing_chat_template_is_an_error(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    for leftover in ("chat_template.jinja",):
        (tmp_path / "m" / leftover).unlink(missing_ok=True)
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path / "m")
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template("hello")


# ---------------------------------------------------------------------------------------------
# tiny GGUF files
# ---------------------------------------------------------------------------------------------

GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_MERGES = ["h e", "l l", "he ll", "Ġ w"]
GGUF_TOKENS = GGUF_SPECIALS + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell", "Ġw"]


def _write_gguf(path: Path, arch: str = "llama", tie: bool = False, layers: int = 2, seed: int = 0,
                rope_scaling: tuple[str, float] | None = None, q8: bool = False) -> Path:  # fmt: skip
    """A tiny GGUF as llama.cpp would write it: byte-level BPE vocabulary, ChatML template.
    ``q8``: every matrix in Q8_0 (the kernels run all the layers; the vocabulary of 263 rows is
    off the kernels' grid, so an untied head stays dense)."""
    hidden, heads, kv_heads, ff = 32, 4, 2, 64
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_types([3] * len(GGUF_SPECIALS) + [1] * (len(GGUF_TOKENS) - len(GGUF_SPECIALS)))
    writer.add_token_merges(GGUF_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.3, offset: float = 0.0) -> np.ndarray:
        """Random values that bfloat16 represents exactly (so the conversion is lossless)."""
        values = torch.from_numpy(offset + scale * rng.standard_normal(shape).astype(np.float32))
        return values.to(torch.bfloat16).float().numpy()

    def matrix(name: str, values: np.ndarray) -> None:
        if q8:
            writer.add_tensor(name, gguf.quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)

    vocab = len(GGUF_TOKENS)
    matrix("token_embd.weight", rand(vocab, hidden))
    if not tie:
        matrix("output.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", rand(hidden, scale=0.1, offset=1.0))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", rand(hidden, scale=0.1, offset=1.0))
        writer.add_tensor(p + "ffn_norm.weight", rand(hidden, scale=0.1, offset=1.0))
        for kind, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            matrix(p + kind + ".weight", rand(rows, hidden))
        if arch == "qwen2":
            writer.add_tensor(p + "attn_q.bias", rand(heads * head_dim))
            writer.add_tensor(p + "attn_k.bias", rand(kv_heads * head_dim))
            writer.add_tensor(p + "attn_v.bias", rand(kv_heads * head_dim))
        matrix(p + "attn_output.weight", rand(hidden, heads * head_dim))
        matrix(p + "ffn_gate.weight", rand(ff, hidden))
        matrix(p + "ffn_up.weight", rand(ff, hidden))
        quantized = gguf.quantize(rand(hidden, ff), GGMLQuantizationType.Q8_0)
        writer.add_tensor(p + "ffn_down.weight", quantized, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers_gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own reading of a GGUF (what ``from_pretrained(gguf_file=...)`` loads)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def _dense_weight(module: torch.nn.Module) -> torch.Tensor:
    return module.weight.detach()


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_gguf_loads_from_the_file(tmp_path: Path, arch: str, tie: bool) -> None:
    path = _write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tie)
    # the dense float32 decoder, every tensor dequantized straight from the file
    loaded = load_model(path, dtype="float32", quantization="none", progress=False)
    home = Path(os.environ["VERISPEC_HOME"])
    assert loaded.source == path and loaded.name == f"tiny-{arch}"
    assert not (home / "converted").exists()  # no checkpoint is written
    meta = metadata_dir(path)
    assert meta.parent == home / "gguf" and re.fullmatch(rf"tiny-{arch}-[0-9a-f]{{12}}", meta.name)
    assert not list(meta.glob("*.safetensors"))
    assert loaded.hf_config["architectures"] == [loader.GGUF_ARCHITECTURES[arch]]
    assert loaded.hf_config["tie_word_embeddings"] is tie
    assert loaded.model.config.qkv_bias is (arch == "qwen2")

    # Weights: transformers' own GGUF reading, exactly (float32, the rotary interleave undone).
    reference = _transformers_gguf_tensors(path)
    model = loaded.model
    assert torch.equal(model.embed.weight, reference["model.embed_tokens.weight"])
    if not tie:
        assert torch.equal(model.lm_head.weight, reference["lm_head.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([reference[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(_dense_weight(layer.qkv), qkv)
        assert torch.equal(_dense_weight(layer.down), reference[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_norm.weight, reference[p + "input_layernorm.weight"])

    # Forward pass: the decoder against transformers loading the same GGUF.
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = [1, 40, 70, 261, 262, 2, 100, 5]
    diff = (_native_logits(loaded, ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff < FP32_ATOL, f"max logit difference {diff:.3g}"

    # Tokenizer, chat template and end-of-generation ids come along.
    tok = loaded.tokenizer
    assert tok.vocab_size == len(GGUF_TOKENS)
    assert tok.eos_token_ids == frozenset({0, 2})  # <|endoftext|> and <|im_end|>
    assert json.loads((meta / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert tok.render_chat("hello") == "<|im_start|>user hello<|im_end|> <|im_start|>assistant "
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_gguf_conversion_for_transformers(tmp_path: Path) -> None:
    """The converted checkpoint transformers' baselines in ``verispec bench`` load: transformers'
    GGUF reading rounded to bfloat16 storage, exactly, with the same tokenizer."""
    from safetensors.torch import load_file

    path = _write_gguf(tmp_path / "tiny-llama.gguf", "llama")
    directory = gguf_convert.convert_gguf(path, progress=False)
    assert directory == converted_dir(path) and directory.parent == Path(os.environ["VERISPEC_HOME"]) / "converted"
    stored = load_file(directory / "model.safetensors")
    reference = _transformers_gguf_tensors(path)
    assert set(stored) == set(reference)
    for name, value in reference.items():
        expected = value.to(torch.bfloat16) if value.dim() >= 2 else value.float()
        assert torch.equal(stored[name], expected), name
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    loaded = load_model(directory, dtype="float32", progress=False)
    diff = (_native_logits(loaded, IDS) - _hf_logits(hf, IDS)).abs().max().item()
    assert diff < FP32_ATOL, f"max logit difference {diff:.3g}"


def test_gguf_metadata_is_cached_and_refreshed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf")
    load_model(path, dtype="float32", progress=False)
    first = metadata_dir(path)
    calls: list[Path] = []
    real = gguf_convert._convert_into
    monkeypatch.setattr(gguf_convert, "_convert_into", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    load_model(path, dtype="float32", progress=False)
    assert calls == []  # straight from the cache

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # "a new file"
    load_model(path, dtype="float32", progress=False)
    refreshed = metadata_dir(path)
    assert refreshed != first and len(calls) == 1
    assert not first.exists()  # the stale entry of the same path was removed
    assert sorted(p.name for p in refreshed.parent.iterdir() if p.is_dir()) == [refreshed.name]


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf")

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf(path, progress=False)
    root = converted_dir(path).parent
    assert [p.name for p in root.iterdir() if p.is_dir()] == []
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_HOME", str(root.parent))
    assert gguf_convert.convert_gguf(path, progress=False) == converted_dir(path)


def test_gguf_conversion_in_several_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", "qwen2")
    single = load_model(gguf_convert.convert_gguf(path, progress=False), dtype="float32", progress=False)
    monkeypatch.setattr(gguf_convert, "CONVERSION_VERSION", gguf_convert.CONVERSION_VERSION + 1000)  # new cache key
    monkeypatch.setattr(gguf_convert, "_SHARD_BYTES", 20_000)
    sharded = load_model(gguf_convert.convert_gguf(path, progress=False), dtype="float32", progress=False)
    assert (sharded.source / "model.safetensors.index.json").is_file()
    assert len(list(sharded.source.glob("model-*-of-*.safetensors"))) > 1
    assert torch.equal(_native_logits(single, IDS), _native_logits(sharded, IDS))


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_gguf_native_load_builds_from_the_blocks(tmp_path: Path) -> None:
    """The default load on the CPU: linear layers on the file's blocks from the start, the
    embedding table left in the file's blocks, everything else dequantized; no checkpoint."""
    from verispec.models.native import GGUFEmbedding, NativeLinear

    path = _write_gguf(tmp_path / "tiny.gguf", "qwen2", q8=True)
    with pytest.warns(UserWarning, match=r"1 linear layer\(s\).*\[263, 32\] cannot be run"):
        native = load_model(path, progress=False)
    dense = load_model(path, dtype="float32", quantization="none", progress=False)
    model = native.model
    assert isinstance(model.embed, GGUFEmbedding) and model.dtype == torch.float32
    assert all(isinstance(getattr(layer, attr), NativeLinear) for layer in model.layers
               for attr in ("qkv", "o_proj", "gate_up", "down"))
    assert isinstance(model.lm_head, torch.nn.Linear)  # 263 rows: off the grid, dense
    assert not (Path(os.environ["VERISPEC_HOME"]) / "converted").exists()
    # the table's rows are the file's values, exactly, read row by row
    ids = torch.tensor([[0, 5, 262], [7, 7, 1]])
    assert torch.equal(model.embed(ids), dense.model.embed(ids))
    assert torch.equal(model.embed.weight, dense.model.embed.weight)
    with pytest.raises(IndexError, match="out of range"):
        model.embed(torch.tensor([[263]]))
    # biases and the layers' weights: the kernels multiply by the file's own values
    for layer, ref in zip(model.layers, dense.model.layers):
        assert torch.equal(layer.qkv.bias, ref.qkv.bias)
        assert torch.equal(layer.qkv.dequantize(), ref.qkv.weight)
    # logits agree with the dense float32 model up to the activations' 8-bit quantization (and
    # the dense head's bf16 weights)
    ours, ref = _native_logits(native, IDS), _native_logits(dense, IDS)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


def test_decoder_built_around_finished_layers() -> None:
    """``Decoder.empty(build=...)``: layers put in while weightless are kept as they are; only the
    rest is allocated."""
    from verispec.models.decoder import Decoder, DecoderConfig

    config = DecoderConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8)
    ready = torch.nn.Linear(32, 32, bias=False)

    def build(model: Decoder) -> None:
        assert model.layers[0].qkv.weight.is_meta
        model.layers[1].o_proj = ready

    model = Decoder.empty(config, dtype=torch.float32, device="cpu", build=build)
    assert model.layers[1].o_proj is ready
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.dtype == torch.float32 and model.device.type == "cpu"


def test_gguf_linear_rope_scaling(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", rope_scaling=("linear", 4.0))
    loaded = load_model(path, dtype="float32", progress=False)
    scaling = loaded.model.config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "linear" and scaling["factor"] == 4.0


def test_gguf_header_reader(tmp_path: Path) -> None:
    header = read_gguf_header(_write_gguf(tmp_path / "tiny.gguf", "qwen2"))
    assert header.architecture == "qwen2"
    assert header.metadata["qwen2.block_count"] == 2
    assert header.metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert header.metadata["tokenizer.ggml.tokens"] is None  # long arrays are skipped
    by_name = {t.name: t for t in header.tensors}
    assert by_name["token_embd.weight"].shape == (len(GGUF_TOKENS), 32)
    assert by_name["blk.0.ffn_down.weight"].ggml_type == GGMLQuantizationType.Q8_0
    reader = gguf.GGUFReader(header.path)
    for tensor in reader.tensors:
        assert by_name[tensor.name].offset == tensor.data_offset  # absolute in both
        assert by_name[tensor.name].nbytes == tensor.n_bytes


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    for missing in (tmp_path / "no-such-model", tmp_path / "no-such.gguf"):
        with pytest.raises(ModelFileNotFoundError, match=re.escape(str(missing))) as info:
            load_model(missing, progress=False)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ModelLoadError)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    message = r"empty is not a Hugging Face model directory: config.json is missing"
    with pytest.raises(ModelFileNotFoundError, match=message):
        load_model(tmp_path / "empty", progress=False)


def test_directory_without_weights(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    for weights in (tmp_path / "m").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelFileNotFoundError, match=r"no weights in .*m: model.safetensors .* is missing$"):
        load_model(tmp_path / "m", progress=False)
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelFileNotFoundError, match="only safetensors checkpoints are supported"):
        load_model(tmp_path / "m", progress=False)


def test_missing_shard(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m", shard=True)
    victim = sorted((tmp_path / "m").glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelFileNotFoundError, match=f"missing: {re.escape(victim.name)}"):
        load_model(tmp_path / "m", progress=False)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file: .*model.safetensors"):
        load_model(tmp_path / "m", progress=False)


def test_bad_config_json(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text("{broken")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_model(tmp_path / "m", progress=False)
    del config["num_attention_heads"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json: required field 'num_attention_heads' is missing"):
        load_model(tmp_path / "m", progress=False)


def test_missing_tokenizer(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (tmp_path / "m" / name).unlink(missing_ok=True)
    with pytest.raises(ModelFileNotFoundError, match="no tokenizer in .*: tokenizer.json is missing"):
        load_model(tmp_path / "m", progress=False)


def test_unsupported_architecture_in_config(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel'.*supports: LlamaForCausalLM, Qwen2ForCausalLM"):
        load_model(tmp_path / "m", progress=False)


def test_unsupported_gguf_architecture_fails_before_conversion(tmp_path: Path) -> None:
    path = write_bare_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", 4)
    with pytest.raises(UnsupportedModelError, match=r"unsupported GGUF architecture 'gpt2'.*llama, qwen2"):
        load_model(path, progress=False)
    assert not converted_dir(path).parent.exists() and not metadata_dir(path).parent.exists()  # nothing was read


# Resolved at import, before the autouse fixture points VERISPEC_HOME at a temporary directory.
REAL_SMOLLM_GGUF = bundled_path("smollm2-135m-instruct") if is_fetched("smollm2-135m-instruct") else None


def _real_gguf_head() -> bytes | None:
    if REAL_SMOLLM_GGUF is None:
        return None
    with open(REAL_SMOLLM_GGUF, "rb") as handle:
        return handle.read(1 << 20)


@pytest.mark.parametrize("case", ["half", "metadata-cut", "real-1mb", "random", "magic-then-garbage", "empty"])
def test_corrupt_or_truncated_gguf(tmp_path: Path, case: str) -> None:
    bad = tmp_path / f"{case}.gguf"
    rng = np.random.default_rng(1)
    if case in ("half", "metadata-cut"):
        data = _write_gguf(tmp_path / "good.gguf").read_bytes()
        bad.write_bytes(data[: len(data) // 2] if case == "half" else data[:200])
    elif case == "real-1mb":
        head = _real_gguf_head()
        if head is None:
            pytest.skip("the bundled SmolLM2 GGUF has not been fetched")
        bad.write_bytes(head)
    elif case == "random":
        bad.write_bytes(rng.bytes(4096))
    elif case == "magic-then-garbage":
        bad.write_bytes(b"GGUF" + rng.bytes(4096))
    else:
        bad.write_bytes(b"")
    message = rf"^corrupt or truncated GGUF file: {re.escape(str(bad.resolve()))} \(.+\)$"
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad, progress=False)


def test_bad_dtype(tmp_path: Path) -> None:
    _tiny_hf(tmp_path / "m")
    message = r"unknown dtype 'int8'; valid dtypes are: auto, float32 \(fp32\), bfloat16 \(bf16\), float16"
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path / "m", dtype="int8", progress=False)
    with pytest.raises(ModelLoadError, match="unknown dtype 'float64'"):  # checked before the path
        load_model(tmp_path / "does-not-exist", dtype="float64", progress=False)
    with pytest.raises(ModelLoadError, match="unsupported dtype torch.int8"):
        load_model(tmp_path / "m", dtype=torch.int8, progress=False)


def test_cuda_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_hf(tmp_path / "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device 'cuda' was requested but CUDA is not available"):
        load_model(tmp_path / "m", device="cuda", progress=False)
    with pytest.raises(ModelLoadError, match="unsupported device 'tpu'|invalid device 'tpu'"):
        load_model(tmp_path / "m", device="tpu", progress=False)


def test_bfloat16_on_a_cuda_device_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.version, "hip", None)
    device = loader.resolve_device("cuda:0")
    message = r"bfloat16 is not supported natively on cuda:0 \(Tesla T4\); use dtype='float16'"
    with pytest.raises(ModelLoadError, match=message):
        loader.resolve_dtype("bf16", device)
    assert loader.resolve_dtype("auto", device) == torch.float16
    with pytest.raises(ModelLoadError, match="device 'cuda:3' does not exist: 1 CUDA device"):
        loader.resolve_device("cuda:3")
