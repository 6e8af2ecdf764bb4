"""The seam to Lightning's private API (``lightning_oobleck.lightning._internals``): every private access the
strategy makes exists on the installed Lightning, and nothing outside the seam makes one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_oobleck.lightning import _internals

PACKAGE = Path(_internals.__file__).resolve().parents[1]
LIGHTNING_IMPORT = re.compile(r"^\s*from lightning[\w.]* import (\([^)]*\)|[^\n]*)", re.MULTILINE)
PRIVATE_ATTRIBUTES = re.compile(
    r"\._(results|data_source|broadcast_sigterm_tensor|signal_connector|checkpoint_connector|combined_loader|"
    r"version|on_before_batch_transfer|call_strategy_hook|summary|max_depth|get_summary_data)\b"
)


@pytest.mark.parametrize("access", sorted(_internals.ACCESSES))
def test_every_private_access_exists_on_this_lightning(access: str) -> None:
    try:
        _internals.ACCESSES[access]()
    except AttributeError as e:
        pytest.fail(
            f"Lightning moved {access} (the seam was checked on {_internals.CHECKED_ON}): {e}; adapt "
            "lightning_oobleck/lightning/_internals.py"
        )


def test_no_module_but_the_seam_touches_lightnings_private_api() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_internals.py":
            continue
        text = path.read_text()
        imports = [
            name for names in LIGHTNING_IMPORT.findall(text) for name in re.findall(r"\b_[a-z]\w*", names)
        ]
        attributes = [m.group(0) for m in PRIVATE_ATTRIBUTES.finditer(text)]
        if imports or attributes:
            offenders.append(f"{path.relative_to(PACKAGE)}: {imports + attributes}")
    assert not offenders, offenders
