"""The README's set-up commands are the ones CI runs, word for word."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_setup_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_states_exactly_two_setup_commands():
    commands = _readme_setup_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in command for command in commands), commands


def test_ci_runs_the_readme_commands():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    install_and_run, run_tests = _readme_setup_commands()
    assert install_and_run in ci_lines
    assert any(line.startswith(run_tests + " ") or line == run_tests for line in ci_lines)


# -- every tfdp-train / tfdp-predict command in the README's shell blocks ------

#: Where a command ends on its line.
_SHELL_OPERATORS = ("&&", "||", "|", ";", ">", ">>", "2>&1", "&")
#: README commands that the lead has yet to fix (see issue 14): strict, so the
#: fix shows up as an unexpected pass to remove from here.
_KNOWN_BROKEN: dict = {}


def _code_blocks():
    """(language, text) of each code block: fenced (fences possibly indented, in
    lists) or indented by 4 spaces after a blank line (language "")."""
    blocks, language, lines, previous = [], None, [], ""
    indented: list = []
    for line in (ROOT / "README.md").read_text().splitlines() + [""]:
        fence = line.strip().startswith("```")
        if language is None and not fence and line.startswith("    ") and (
                indented or not previous.strip()):
            indented.append(line.strip())
        elif indented:
            blocks.append(("", "\n".join(indented)))
            indented = []
        if fence and language is None:
            language, lines = line.strip()[3:].strip(), []
        elif fence:
            blocks.append((language, "\n".join(lines)))
            language = None
        elif language is not None:
            lines.append(line.strip())
        previous = line
    return blocks


def _readme_commands(program):
    """Each `program` command in the README's shell code blocks: its arguments,
    continuation lines joined, elided flags (`...`) dropped, cut at the first
    shell operator."""
    import shlex

    commands = []
    for language, block in _code_blocks():
        if language not in ("", "bash", "sh", "shell"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            if not re.search(rf"(^|\s){re.escape(program)}(\s|$)", line):
                continue
            words = shlex.split(line, comments=True)
            args = words[words.index(program) + 1:]
            for i, word in enumerate(args):
                if word in _SHELL_OPERATORS:
                    args = args[:i]
                    break
            commands.append([word for word in args if word != "..."])
    return commands


def _params(commands):
    params = []
    for args in commands:
        broken = [reason for words, reason in _KNOWN_BROKEN.items()
                  if " ".join(words) in " ".join(args)]
        marks = [pytest.mark.xfail(strict=True, reason=broken[0])] if broken else []
        params.append(pytest.param(args, id=" ".join(args)[:90], marks=marks))
    return params


def test_the_readme_has_train_and_predict_commands():
    assert len(_readme_commands("tfdp-train")) >= 10
    assert len(_readme_commands("tfdp-predict")) >= 2


@pytest.mark.parametrize("args", _params(_readme_commands("tfdp-train")))
def test_each_readme_train_command_parses_and_its_model_fits_its_dataset(args):
    """The flags parse into a RunConfig and pass tfdp-train's checks before the
    strategy (names, --model against --dataset, splits). Your own files
    (--dataset=tfrecord, python:) are not there to read; a TFDS dataset need
    not be prepared here."""
    from absl import flags

    from tfdp.app import train as train_cli
    from tfdp.app import user_data

    flags.FLAGS.unparse_flags()
    try:
        flags.FLAGS(["tfdp-train", *args])
        config = train_cli.config_from_flags()
        if config.dataset != user_data.TFRECORD and not config.dataset.startswith(
                user_data.PYTHON_PREFIX):
            train_cli._check_names(config)
        train_cli._check_inputs(config, require_prepared=False)
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.slow
def test_readme_predict_commands_parse_and_no_check_starts_tensorflow():
    """In a fresh process (tfdp-predict's flags clash with tfdp-train's): each
    README tfdp-predict command parses and names a split its dataset has; then
    every registered dataset is described and checked against every model, and
    the CPU can still be split into logical devices afterwards, i.e. none of it
    started TensorFlow's runtime (which must wait for the strategy)."""
    import json
    import subprocess
    import sys

    script = """
import json, sys, types
from absl import flags
import tfdp
from tfdp.app import predict  # defines the flags
from tfdp.app import compatibility, data_description, run_config
from tfdp import models, pipelines
results = []
for args in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["tfdp-predict", *args])
    name = flags.FLAGS.dataset
    if name and name != "tfrecord":
        pipelines.check_source_name(name)
        data = data_description.describe_before_strategy(types.SimpleNamespace(
            dataset=name, data_dir=flags.FLAGS.data_dir, image_size=None, image_channels=3,
            num_classes=None, eval_files=None))
        compatibility.eval_split(flags.FLAGS.split, data, flag="--split")
    results.append(args)
for name in pipelines.known_sources():
    data = data_description.describe_before_strategy(run_config.RunConfig(dataset=name))
    for model in models.names():
        try:
            compatibility.check(model, data)
        except compatibility.IncompatibleError:
            pass
tfdp.configure_cpu_devices(2)
import tensorflow as tf
print(json.dumps({"parsed": len(results), "cpus": len(tf.config.list_logical_devices("CPU"))}))
"""
    commands = _readme_commands("tfdp-predict")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(commands)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"parsed": len(commands), "cpus": 2}
