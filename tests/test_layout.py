"""Layering rules: `tfdp` never imports `pipelines` or `models`."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {"pipelines", "models"}


def _imported_top_level_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "tfdp").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_tfdp_does_not_import_pipelines_or_models(path):
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in _imported_top_level_modules(path)
        if name in FORBIDDEN
    ]
    assert not offending, offending
