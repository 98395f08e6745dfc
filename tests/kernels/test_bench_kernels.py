"""`verispec bench kernels` runs end to end on the small real model and reports every section it
was asked for (the figures themselves are the machine's, so only their presence and sense are
checked)."""

from __future__ import annotations

import json

import pytest
import torch

from verispec import kernels
from verispec.bench.presets import kernels as preset


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (no compiler)")
def test_bench_kernels_reports_its_sections(capsys):
    threads = torch.get_num_threads()
    try:
        assert preset.main(["--model", "smollm2-135m-instruct", "--repeats", "1", "--sections", "shapes,paths,model,bounds,calls,attention"]) == 0
    finally:
        torch.set_num_threads(threads)  # the preset sets its own
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["read_gbps"] > 0
    kinds = {row["layer"] for row in result["shapes"]}
    assert {"qkv", "o_proj", "gate_up", "down", "lm_head"} <= kinds
    assert all(row["t1_ms"] > 0 and set(row["ratios"]) == {str(m) for m in preset.ROWS[1:]} for row in result["shapes"])
    assert {row["layer"] for row in result["paths"]} == kinds
    m = result["model_passes"]
    assert m["decode_ms"] > 0 and m["long_decode_ms"] > 0 and m["prefill_700_s"] > 0
    assert set(m["verify"]) == {str(t) for t in preset.POSITIONS[1:]}
    assert len(m["long_verify9"]) == 3 and m["long_verify9"][1] <= m["long_verify9"][0] <= m["long_verify9"][2]
    assert f"after {preset.LONG_CONTEXT} cached tokens" in out
    path = result["prefill_path"]
    assert isinstance(path["dense_copies"], bool) and f"prefill path: {path['text']}" in out
    assert "kernels_s" not in path or (path["kernels_s"] > 0 and path["bf16_gemm_s"] > 0)
    att = result["attention"]
    assert [(r["cached"] + r["positions"], r["positions"]) for r in att] == list(preset.ATTENTION_SHAPES)
    paths = {"default", preset.HALF_CACHE} | {i for i in kernels.supported_isas() if i != "scalar"}
    assert all(set(r["ms"]) == paths and all(lo <= med <= hi for med, lo, hi in r["ms"].values()) and r["model_ms"] > 0
               for r in att)
    assert "attention, one layer" in out and "(float16 cache) |" in out  # the native model's cache
    calls = result["calls"]
    assert set(calls) == {"T=1", "T=9"}
    assert all(c["one_call_ms"] > 0 and c["python_ms"] > 0 and c["ratio"][1] <= c["ratio"][0] <= c["ratio"][2]
               for c in calls.values())
    if kernels.best_isa() in ("avx512", "amx"):
        b = result["bounds"]
        assert b["step_ms"] > 0 and b["clock_ghz"] > 0 and b["zmm_per_cycle"] in (1, 2)
        assert set(b["passes"]) == {str(t) for t in preset.BOUND_POSITIONS}
        for t, r in b["passes"].items():
            assert r["blocks"] == preset.avx512_row_blocks(int(t))
            assert r["bound"] >= 1.0  # the model's formats (Q4_1, Q8_0) all have counts
            assert r["measured_over_bound"] == pytest.approx(r["measured"][0] / r["bound"])
            assert r["compute_ms"] > 0 and r["bound"] == pytest.approx(max(1.0, r["compute_ms"] / b["step_ms"]))
        assert "| T | row blocks | matmuls' instructions, ms | pass / step | bound / step | measured / bound |" in out
    else:
        assert "bounds: skipped" in out


def test_avx512_row_blocks_are_the_fewest_even_blocks_and_each_costs_one_unpacking():
    for m in range(1, 61):
        blocks = preset.avx512_row_blocks(m)
        assert sum(blocks) == m and len(blocks) == -(-m // preset.MAX_BLOCK)
        assert max(blocks) <= preset.MAX_BLOCK and max(blocks) - min(blocks) <= 1
    assert preset.avx512_row_blocks(9) == [9] and preset.avx512_row_blocks(17) == [9, 8]
    for fmt, c in preset.AVX512_OPS.items():
        ops = {m: preset.avx512_superblock_ops(fmt, m) for m in range(1, 26)}
        # within one block a row adds its own instructions only; the 13th row starts a second
        # block, which splits the weights again (and makes the scales again where a call takes
        # several superblocks)
        again = c["weights"] + (c["scales"] if c["kb"] == 32 else 0)
        assert all(ops[m + 1] - ops[m] == c["per_row"] for m in range(4, 12))
        assert ops[13] - ops[12] == again + c["per_row"]
        assert ops[25] - ops[24] == again + c["per_row"]

