"""`verispec bench gguf`: its options, the llama.cpp runs it parses, and a file verispec does not run.

llama.cpp's binaries are stood in for by small scripts that print what the real ones print;
the speed and footprint sections' own figures come from real runs, not from these tests.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from gguf_reference import write_bare_gguf
from verispec.bench.presets import gguf as preset


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def llama_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # llama-bench -o json prints a log line first, then the JSON array
    _script(bin_dir / "llama-bench", "import json, sys\nprint('build: test')\n"
            "n = int(sys.argv[sys.argv.index('-n') + 1])\n"
            "print(json.dumps([{'n_gen': n, 'avg_ts': 25.5 + n / 1000}]))\n")
    _script(bin_dir / "llama-completion", "x = bytearray(64 << 20)\nprint('done')\n")
    return bin_dir


def test_options_are_checked(tmp_path: Path, llama_bin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = preset.parse_args(["--files", "a.gguf", "--llama-bin", str(llama_bin)])
    assert args.sections == list(preset.SECTIONS) and args.threads == 2 and args.context == 4096
    for argv, message in ((["--llama-bin", str(tmp_path)], "holds no llama-bench binary"),
                          (["--llama-bin", str(llama_bin), "--sections", "speed,disk"], "unknown section(s) disk"),
                          (["--llama-bin", str(llama_bin), "--context", "8"], "--context must be at least 16")):
        with pytest.raises(SystemExit):
            preset.parse_args(["--files", "a.gguf", *argv])
        assert message in capsys.readouterr().err


def test_llama_runs_are_parsed_and_measured(tmp_path: Path, llama_bin: Path) -> None:
    assert preset._llama_bench(llama_bin, tmp_path / "m.gguf", 64, 2) == pytest.approx(25.564)
    assert preset._llama_generator(llama_bin) == llama_bin / "llama-completion"
    run = preset._run([str(llama_bin / "llama-completion")])
    assert run["output"].strip() == "done" and run["max_rss_bytes"] >= 64 << 20 and run["wall_s"] > 0
    with pytest.raises(SystemExit, match="exited with 3"):
        preset._run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(bytes(1000))
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "a")
    assert preset._du(tmp_path / "d") == 1000


def test_a_file_verispec_does_not_run_is_reported(tmp_path: Path, llama_bin: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = write_bare_gguf(tmp_path / "ssm.gguf", "mamba", 32)
    out = tmp_path / "r.json"
    assert preset.main(["--files", str(path), "--llama-bin", str(llama_bin), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    entry = report["files"]["ssm.gguf"]
    assert "unsupported GGUF architecture 'mamba'" in entry["not_run"]
    assert "speed" not in entry and "footprint" not in entry
    assert "verispec does not run it" in capsys.readouterr().out


def test_synthetic_files_have_the_shape_and_types_of_q4_k_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            llama_bin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gguf import GGMLQuantizationType as T

    from verispec.models.inspect import inspect_gguf

    monkeypatch.setitem(preset.SHAPES, "tiny", dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=1024,
                                                    context=2048))
    path = preset.write_synthetic(tmp_path / "s.gguf", "tiny")
    r = inspect_gguf(path)
    assert r.runs is None and r.dense_layers == 0
    assert (r.layers, r.hidden, r.ffn, r.heads, r.kv_heads, r.vocab) == (2, 256, 512, 4, 2, 1024)
    counts = {t.type_name: t.tensors for t in r.types}
    assert counts == {T.Q4_K.name: 1 + 2 * 7 - 2, T.Q6_K.name: 1 + 2, T.F32.name: 2 * 2 + 1}
    mtime = path.stat().st_mtime_ns
    assert preset.write_synthetic(path, "tiny") == path and path.stat().st_mtime_ns == mtime  # written once
    with pytest.raises(SystemExit):
        preset.parse_args(["--synthetic", "llama-70b", "--llama-bin", str(llama_bin)])
    assert "unknown synthetic shape(s) llama-70b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preset.parse_args(["--llama-bin", str(llama_bin)])
    assert "name --files, --synthetic or both" in capsys.readouterr().err
