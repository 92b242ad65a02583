"""Layering rules: `tfdp` never imports `pipelines` or `models`.

The one exception is the `tfdp-train` entry point, `tfdp/train.py`, whose job
is to wire them into the library (`tfdp.experiment` takes them as arguments).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {"pipelines", "models"}
ENTRY_POINTS = {"tfdp/train.py"}


def _imported_top_level_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (ROOT / "tfdp").rglob("*.py")
           if str(p.relative_to(ROOT)) not in ENTRY_POINTS),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_tfdp_does_not_import_pipelines_or_models(path):
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in _imported_top_level_modules(path)
        if name in FORBIDDEN
    ]
    assert not offending, offending
