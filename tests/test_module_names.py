"""A word names one thing across the package: "report" is the reviewer's HTML report (``shardline report``), and
"staged" is an async save's copy of the state in host buffers."""

from __future__ import annotations

import ast
from pathlib import Path

import shardline

ROOT = Path(shardline.__file__).parent
# Public names that use the words in their plain sense, each for the one thing it says.
PLAIN = {
    "VerifyReport": "what verify_checkpoint found",
    "LineageReport": "what audit found",
    "StagedTensor": "one tensor of an async save's host copy",
    "StagedDigester": "hashes an async save's host copy",
    "digest_staged": "the digests of an async save's host copy",
}


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.rglob("*.py"))


def _public_names() -> dict[str, str]:
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                names[node.name] = str(path.relative_to(ROOT))
    return names


def test_only_the_html_report_is_named_report() -> None:
    named = [m for m in _modules() if "report" in m and not m.startswith("report/") and m != "cli/report"]
    assert named == [], "name these modules for what they hold: the HTML report is shardline.report"


def test_no_module_is_named_for_staging() -> None:
    assert [m for m in _modules() if "stag" in m] == []


def test_public_names_say_report_or_staged_only_for_their_one_thing() -> None:
    wrong = [
        f"{name} ({path})"
        for name, path in _public_names().items()
        if ("report" in name.lower() and not path.startswith("report/")) or "stag" in name.lower()
        if name not in PLAIN
    ]
    assert wrong == []
    assert len(_public_names()) > 300  # the walk saw the package
