"""Private TensorFlow and Keras API is touched only under `tfdp/_upstream/` and `pipelines/_upstream.py`.

Those modules are version-gated and each has a canary test in
`tests/_upstream/` that fails when upstream changes; a private touch anywhere
else would break silently with the next release. Scanned (AST, every module
tfdp installs): imports of `tensorflow.python`, `keras.src` and other private
upstream modules, `tf.__internal__`, and attributes with a leading underscore
that tfdp's own code does not define (so they belong to a TensorFlow, Keras
or standard-library object).
"""

import ast

import pytest

from test_layout import MODULES, ROOT, _imports

QUARANTINE = ("tfdp/_upstream/", "pipelines/_upstream.py")
PRIVATE_MODULES = ("tensorflow.python", "tensorflow.compiler", "tensorflow.core",
                   "tensorflow.tsl", "keras.src", "tf_keras.src")
#: Private-looking names of the standard library that are public API.
STDLIB_PUBLIC = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make"}


def _scanned():
    return sorted(path for path in MODULES.values()
                  if not str(path.relative_to(ROOT)).startswith(QUARANTINE))


def _own_private_names():
    """Underscore names tfdp defines: functions, classes, attributes, module globals."""
    names = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return {name for name in names if name.startswith("_")}


OWN_PRIVATE_NAMES = _own_private_names()


def _private_touches(path):
    for line, module in _imports(path):
        if module.startswith(PRIVATE_MODULES):
            yield line, f"import of {module}"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if name == "__internal__":
                yield node.lineno, f"{ast.unparse(node)}"
            elif (name.startswith("_") and not name.startswith("__")
                  and name not in OWN_PRIVATE_NAMES and name not in STDLIB_PUBLIC):
                yield node.lineno, f"{ast.unparse(node)} (not defined by tfdp)"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__") \
                and node.args[1].value not in OWN_PRIVATE_NAMES:
            yield node.lineno, f"{ast.unparse(node)} (not defined by tfdp)"


@pytest.mark.parametrize("path", _scanned(), ids=lambda p: str(p.relative_to(ROOT)))
def test_private_upstream_api_only_in_the_quarantine(path):
    touches = [f"line {line}: {what}" for line, what in _private_touches(path)]
    assert not touches, (
        f"{path.relative_to(ROOT)} touches private TensorFlow/Keras API: {touches}. "
        f"Move it into tfdp/_upstream/ (version-gated, with a canary test in tests/_upstream/)")


def test_the_scan_finds_a_private_touch(tmp_path):
    # The scan itself: a planted touch of each kind is found.
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import tensorflow as tf\n"
        "from keras.src.trainers import trainer\n"
        "tf.__internal__.distribute.strategy_supports_no_merge_call()\n"
        "def f(optimizer):\n"
        "    return optimizer._trainable_variables_never_defined_by_tfdp\n"
        "getattr(tf, '_another_private_name')\n")
    assert sorted(line for line, _ in _private_touches(planted)) == [2, 3, 5, 6]


def test_the_quarantine_exists():
    # Renaming tfdp/_upstream/ would make the scan vacuous.
    quarantined = [path for path in MODULES.values()
                   if str(path.relative_to(ROOT)).startswith(QUARANTINE)]
    assert len(quarantined) >= 5
    assert any(_private_touches(path) for path in quarantined)
