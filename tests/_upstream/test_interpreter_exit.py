"""`tfdp._upstream.interpreter_exit.exit_without_teardown`: a normal exit minus the teardown.

Runs a small Python process that loads the module by path (no TensorFlow),
so what the process leaves behind is what a real exit leaves.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "tfdp" / "_upstream" / "interpreter_exit.py"

SCRIPT = textwrap.dedent("""
    import atexit, importlib.util, sys, threading, time
    spec = importlib.util.spec_from_file_location("interpreter_exit", sys.argv[1])
    interpreter_exit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(interpreter_exit)
    out = sys.argv[2]

    def write(name):
        with open(f"{out}/{name}", "w") as f:
            f.write(name)

    class Teardown:  # finalized only by the interpreter's teardown
        def __init__(self, path):
            self.path, self.open = path, open  # module globals may be gone by then

        def __del__(self):
            with self.open(self.path, "w") as f:
                f.write("teardown")

    KEEP = Teardown(f"{out}/teardown")
    atexit.register(write, "atexit")
    def late():
        time.sleep(0.3)
        write("thread")
    threading.Thread(target=late).start()  # not a daemon: waited for
    print("buffered, no newline", end="")  # a pipe: block-buffered until flushed
    interpreter_exit.exit_without_teardown(3)
    write("after")  # never reached
""")


def test_waits_for_threads_runs_atexit_flushes_and_skips_only_the_teardown(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(MODULE), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "thread"]


def test_the_same_script_with_a_normal_exit_does_tear_down(tmp_path):
    # The reference: what the test above shows missing is really the teardown.
    script = SCRIPT.replace("interpreter_exit.exit_without_teardown(3)", "sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", script, str(MODULE), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "teardown", "thread"]


def test_without_cpythons_run_exitfuncs_it_exits_normally(tmp_path):
    # The version gate: no private hook to run the atexit handlers, no shortcut.
    script = SCRIPT.replace("interpreter_exit = importlib.util.module_from_spec(spec)",
                            "interpreter_exit = importlib.util.module_from_spec(spec)\n"
                            "del atexit._run_exitfuncs")
    done = subprocess.run([sys.executable, "-c", script, str(MODULE), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "teardown", "thread"]
