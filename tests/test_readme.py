"""The README's set-up commands are the ones CI runs, word for word."""

import pathlib
import re

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
