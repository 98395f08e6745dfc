"""The README's commands run as written.

Every ``verispec`` command in the README's ``bash`` blocks must parse with the real command line;
the cheap ones (``--help`` forms, ``verispec plan`` without ``--measure``, ``verispec models
list``) are run, and every ``make`` target named must exist in the Makefile.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from verispec.bench.presets import PRESETS
from verispec.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def readme_commands() -> list[list[str]]:
    """Each command of the README's bash blocks as argv, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


COMMANDS = readme_commands()
VERISPEC = [argv[1:] for argv in COMMANDS if argv[0] == "verispec"]


def is_cheap(args: list[str]) -> bool:
    return ("--help" in args or args == ["models", "list"]
            or (args[:1] == ["plan"] and "--measure" not in args))


def test_the_readme_is_a_short_guide():
    assert len(README.splitlines()) <= 250
    assert any(is_cheap(args) for args in VERISPEC) and any(not is_cheap(args) for args in VERISPEC)


@pytest.mark.parametrize("args", VERISPEC, ids=[" ".join(a)[:60] for a in VERISPEC])
def test_every_verispec_command_parses(args):
    if args[:1] == ["bench"] and len(args) > 1 and args[1] in PRESETS:
        assert "--help" in args  # a preset's options are checked by running its --help below
        return
    if "--help" in args:
        return  # run below
    build_parser().parse_args(args)


@pytest.mark.parametrize("args", [a for a in VERISPEC if is_cheap(a)],
                         ids=[" ".join(a)[:60] for a in VERISPEC if is_cheap(a)])
def test_cheap_commands_run(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(args)
    except SystemExit as exit_:  # --help
        code = exit_.code
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def test_every_make_target_exists():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = {t for argv in COMMANDS if argv[0] == "make" for t in argv[1:] if "=" not in t}
    targets |= set(re.findall(r"`make ([\w-]+)`", README))
    assert targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target
