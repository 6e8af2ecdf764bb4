"""Shared test setup: make ``examples/`` importable (``from gpt.model import ...``)."""

from __future__ import annotations

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
