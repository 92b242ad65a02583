"""Source snippets for the plain-Python workers of the launcher tests."""

# Every worker script starts with this: it records the worker's pid in
# $PID_DIR/worker<RANK>.pid (atomically, so a reader never sees half a file).
PRELUDE = """
import os, signal, subprocess, sys, time
RANK = int(os.environ["TFDP_RANK"])
PID_DIR = os.environ["PID_DIR"]

def write_pid(name, pid):
    path = os.path.join(PID_DIR, name + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{pid}\\n")
    os.replace(path + ".tmp", path)

def wait_for_pid(name):
    path = os.path.join(PID_DIR, name + ".pid")
    while not os.path.exists(path):
        time.sleep(0.02)

write_pid(f"worker{RANK}", os.getpid())
"""
