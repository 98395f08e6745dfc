"""JSON files of a model directory, read with errors that name the file (locks and durable
renames are in :mod:`verispec.files`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verispec.models.errors import ModelLoadError

def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a clear :class:`ModelLoadError` if it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data
