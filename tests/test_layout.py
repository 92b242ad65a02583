"""The floor plan, read from the code's own imports.

- Layers, bottom to top: the library's shared checks and upstream fixes
  (`tfdp._checks`, `tfdp._upstream`), the runtime wing (`tfdp.distribute`),
  the training and inference wings (`tfdp.training`,
  `tfdp.inference`), the public API (`tfdp`,
  `tfdp.optimizers`, `tfdp.callbacks`); beside the library, the input
  pipelines (`tfdp.pipelines`), the models (`tfdp.models`) and the launcher
  (`tfdp.launch`); above everything, the application (`tfdp.app`) and the
  benchmarks (`tfdp.bench`). No module imports one of a higher layer.
- No import loop, counting imports inside functions too.
- Everything lives under the `tfdp` namespace: nothing imports the bare
  folder names (`pipelines`, `models`, `launch`, `app`, `bench`).

`tests/test_upstream_boundary.py` holds the other wall: private TensorFlow and
Keras API only under `tfdp/_upstream/` and `pipelines/_upstream.py`.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: installed package -> its folder in the repository (setup.cfg's package_dir)
PACKAGE_DIRS = {
    "tfdp.app": "app",
    "tfdp.bench": "bench",
    "tfdp.launch": "launch",
    "tfdp.models": "models",
    "tfdp.pipelines": "pipelines",
    "tfdp": "tfdp",
}
BARE_NAMES = {"app", "bench", "launch", "models", "pipelines"}


def _module_files():
    """{dotted module name: path} for every module tfdp installs."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            modules.setdefault(name, path)
    return modules


MODULES = _module_files()


def _imports(path):
    """(line, imported module) for every import in `path`, function-level ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                # `from package import module` imports the module
                submodule = f"{node.module}.{alias.name}"
                yield node.lineno, submodule if submodule in MODULES else node.module


def _layer(module):
    """The layer of a tfdp module: higher layers may import lower ones only."""
    if module in ("tfdp._checks",) or module.startswith("tfdp._upstream"):
        return 0
    if module.startswith("tfdp.distribute"):
        return 1
    if module.startswith(("tfdp.training", "tfdp.inference")):
        return 2  # the training and inference wings, side by side
    if module.startswith(("tfdp.pipelines", "tfdp.models", "tfdp.launch")):
        return 3  # beside the library: may use all of it
    if module in ("tfdp", "tfdp.optimizers", "tfdp.callbacks", "tfdp.compression"):
        return 3  # the public API: names from both wings
    if module.startswith(("tfdp.app", "tfdp.bench")):
        return 4
    raise AssertionError(f"{module}: no layer; add it to tests/test_layout.py")


#: Modules of one layer that must not import each other: the packages beside
#: the library stay independent of one another (the launcher loads no
#: TensorFlow; the input pipelines do not know the models).
INDEPENDENT = ("tfdp.pipelines", "tfdp.models", "tfdp.launch")


def _family(module):
    return next((name for name in INDEPENDENT if module.startswith(name)), None)


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_layer(module):
    offending = []
    for line, imported in _imports(MODULES[module]):
        if imported not in MODULES or imported == module:
            continue
        if _layer(imported) > _layer(module):
            offending.append(f"line {line} imports {imported} (layer {_layer(imported)} > "
                             f"{_layer(module)})")
        family = _family(imported)
        if family and _family(module) not in (None, family):
            offending.append(f"line {line} imports {imported}: {_family(module)} and "
                             f"{family} stay independent")
    assert not offending, f"{MODULES[module].relative_to(ROOT)}: {offending}"


def test_launcher_imports_only_the_light_runtime_modules():
    # The launcher starts in well under a second: no TensorFlow, so from the
    # library only the modules that load without it.
    light = {"tfdp", "tfdp._checks", "tfdp.distribute.cluster", "tfdp.distribute.local_cluster",
             "tfdp.distribute.slurm_env", "tfdp.distribute.visible_gpus"}
    for module, path in MODULES.items():
        if not module.startswith("tfdp.launch"):
            continue
        heavy = [f"line {line}: {imported}" for line, imported in _imports(path)
                 if imported in MODULES and not imported.startswith("tfdp.launch")
                 and imported not in light]
        assert not heavy, f"{path.relative_to(ROOT)}: {heavy}"


def test_no_import_loop():
    graph = {module: sorted({imported for _, imported in _imports(path)
                             if imported in MODULES and imported != module})
             for module, path in MODULES.items()}
    # Tarjan's strongly connected components, iteratively.
    index, low, on_stack, stack, loops = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(graph[successor])))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
    assert not loops, f"import loops: {loops}"


@pytest.mark.parametrize(
    "path",
    sorted({*MODULES.values(), *(ROOT / "tests").rglob("*.py")}),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_nothing_imports_the_bare_folder_names(path):
    offending = [f"line {line} imports {name}" for line, name in _imports(path)
                 if name.split(".")[0] in BARE_NAMES]
    assert not offending, (f"{path.relative_to(ROOT)}: {offending}; import them under "
                           f"the tfdp namespace (`from tfdp import pipelines`)")


def test_every_folder_is_a_package():
    # A folder without __init__.py would install as a namespace package
    # only in editable mode, and be missing from a wheel.
    for folder in PACKAGE_DIRS.values():
        for directory in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            if directory.name == "__pycache__" or not any(directory.glob("*.py")):
                continue
            assert (directory / "__init__.py").exists(), directory.relative_to(ROOT)


def test_setup_cfg_installs_every_package():
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    installed = set(config["options"]["packages"].split())
    packages = {module for module, path in MODULES.items() if path.name == "__init__.py"}
    assert installed == packages
    package_dir = dict(line.split(" = ") for line in
                       config["options"]["package_dir"].strip().splitlines())
    assert package_dir == PACKAGE_DIRS


@pytest.mark.slow
def test_a_users_own_models_py_does_not_shadow_tfdps(tmp_path):
    # Before the namespace, `models`, `launch` and `pipelines` were top-level
    # names: a models.py in the working directory replaced tfdp's.
    import subprocess
    import sys

    for name in ("models", "launch", "pipelines"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    code = ("from tfdp import models, pipelines, launch; "
            "print(models.__file__, pipelines.__file__, launch.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert str(tmp_path) not in result.stdout
