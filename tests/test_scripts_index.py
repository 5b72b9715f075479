"""scripts/README.md lists every script in scripts/, and names no script that is not there."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_every_script_is_listed_once_and_every_listed_script_exists():
    text = (SCRIPTS / "README.md").read_text()
    listed = re.findall(r"^\| `([^`]+)` \|", text, flags=re.MULTILINE)
    present = sorted(p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh", ".c") and p.is_file())
    assert present, "no scripts found"
    assert sorted(set(listed)) == present, (
        f"scripts/README.md is out of date: not listed {sorted(set(present) - set(listed))}, "
        f"listed but missing {sorted(set(listed) - set(present))}")
    assert len(listed) == len(set(listed)), "a script is listed twice in scripts/README.md"
