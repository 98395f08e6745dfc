"""Training prompts for `verispec train-drafter`, made from the Python standard library.

Each prompt asks for a function that the standard library has, described by the first paragraph
of its docstring, in one of four phrasings. They share nothing with Spec-Bench or the code-edit
prompts, so heads trained on them are measured on prompts they never saw. The list is the same
on every machine with the same Python (sorted modules and names, no randomness).

    python stdlib_prompts.py 320 > prompts.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

MODULES = ("base64", "bisect", "calendar", "colorsys", "csv", "difflib", "email.utils", "filecmp", "fnmatch",
           "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "html", "imghdr",
           "inspect", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "mimetypes",
           "ntpath", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib",
           "posixpath", "pprint", "quopri", "random", "re", "reprlib", "secrets", "shlex", "shutil", "smtplib",
           "statistics", "string", "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap",
           "threading", "tokenize", "traceback", "types", "typing", "urllib.parse", "urllib.request", "uuid",
           "warnings", "weakref", "webbrowser", "zipfile")

PHRASINGS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. {doc} Include a docstring.",
    "I need a Python function with the signature `{sig}`. What it should do: {doc}",
    "Show me how to write `{sig}` from scratch in Python (without the standard library's {module}). {doc}",
)


def functions():
    """(module, name, signature, first docstring paragraph) of the public, documented Python
    functions of MODULES, sorted."""
    seen = set()
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if name.startswith("_") or fn.__module__ != module.__name__ or name in seen:
                continue
            doc = inspect.getdoc(fn) or ""
            para = " ".join(doc.split("\n\n")[0].split())
            if len(para) < 40:
                continue
            try:
                sig = f"{name}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                continue
            seen.add(name)
            yield module_name, name, sig, para


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 320
    for i, (module, _name, sig, doc) in enumerate(list(functions())[:count]):
        print(json.dumps({"prompt": PHRASINGS[i % len(PHRASINGS)].format(sig=sig, doc=doc, module=module)}))


if __name__ == "__main__":
    main()
