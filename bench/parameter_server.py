"""Images/s of asynchronous parameter-server training against MultiWorkerMirrored, with a straggler.

    python -m tfdp.bench.parameter_server [--runs 3] [--steps 300] [--batch 64]

Four cases, each `--runs` times on this host, each run a fresh set of
processes: `ps` (a chief, 2 worker tasks and 1 ps task;
`tfdp.make_strategy(kind="parameter_server")`, `tfdp.Trainer`), `ps_straggler`
(the same, worker task 1 held to half a CPU by `tfdp.bench.straggler.cpu_limited`),
`sync` (2 workers under `tfdp-launch --nproc_per_node 2`,
MultiWorkerMirroredStrategy, `tfdp.Trainer`) and `sync_straggler` (worker 1
at half a CPU). The model is the digits MLP (64-256-256-10, SGD 0.05, synthetic
digits-shaped data), `--batch` examples per worker per step: a parameter-server
step is one batch on one worker, a synchronous step a global batch of
2 x `--batch`. Each run trains `--warmup` steps, then times `--steps` more
(`Trainer.train`'s `examples_per_second` of that call), and prints one JSON
line per run with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER_SERVE = "from tfdp.distribute import parameter_server; parameter_server.serve()"


def _job(kind: str, steps: int, warmup: int, batch: int) -> None:
    """One training program: the PS chief (`kind="ps"`) or one synchronous worker."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp

    strategy = tfdp.make_strategy(kind="parameter_server" if kind == "ps" else "multi_worker")
    replicas = strategy.num_replicas_in_sync
    global_batch = batch * replicas
    rng = np.random.default_rng(0)
    x = rng.random((4096, 64), dtype=np.float32)
    y = rng.integers(0, 10, 4096).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch,
                                                                      drop_remainder=True)
    data = data.take(4096 // global_batch)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.05)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy, batch=tfdp.BatchConfig.from_global(global_batch, replicas),
        steps_per_loop=10)
    trainer.train(data, steps=warmup)
    logs = trainer.train(data, steps=warmup + steps)
    if kind == "ps" or trainer.info.is_chief:
        print("RESULT " + json.dumps({"images_per_second": logs["examples_per_second"],
                                      "loss": logs["loss"]}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the coordinator's threads would keep a PS chief alive


def _environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def _result(stdout: str) -> dict:
    lines = [line.split("RESULT ", 1)[1] for line in stdout.splitlines() if "RESULT " in line]
    if not lines:
        raise RuntimeError(f"no RESULT line in:\n{stdout[-3000:]}")
    return json.loads(lines[-1])


def run_ps(*, straggler: bool, steps: int, warmup: int, batch: int, timeout: float) -> dict:
    """One parameter-server run (its own processes); returns the chief's result."""
    from tfdp.bench import straggler as straggler_lib
    from tfdp.distribute import local_cluster

    configs = local_cluster.parameter_server_tf_configs(2, 1)
    servers = []
    try:
        with straggler_lib.cpu_limited(0.5) if straggler else _nothing() as group:
            for config in configs[1:]:
                servers.append(subprocess.Popen(
                    [sys.executable, "-c", WORKER_SERVE], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=_environment({"TF_CONFIG": json.dumps(config)})))
            if group is not None:
                group.add(servers[1].pid)  # worker task 1
            chief = subprocess.run(
                [sys.executable, "-m", "tfdp.bench.parameter_server", "--job", "ps",
                 "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch)],
                env=_environment({"TF_CONFIG": json.dumps(configs[0])}), capture_output=True,
                text=True, timeout=timeout)
            if chief.returncode != 0:
                raise RuntimeError(f"chief failed:\n{chief.stderr[-3000:]}")
            return _result(chief.stdout)
    finally:
        for server in servers:
            server.kill()
            server.wait()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_sync(*, straggler: bool, steps: int, warmup: int, batch: int, timeout: float) -> dict:
    """One MultiWorkerMirrored run of 2 workers under tfdp-launch; returns rank 0's result."""
    job = [sys.executable, "-m", "tfdp.bench.parameter_server", "--job", "sync", "--steps",
           str(steps), "--warmup", str(warmup), "--batch", str(batch)]
    if straggler:
        job = [sys.executable, "-m", "tfdp.bench.straggler", "--rank", "1",
               "--cpu_fraction", "0.5", "--", *job]
    done = subprocess.run([sys.executable, "-m", "tfdp.launch", "--nproc_per_node", "2", "--",
                           *job], env=_environment(), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"launch failed:\n{done.stderr[-3000:]}")
    return _result(done.stdout)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfdp.bench.parameter_server")
    parser.add_argument("--job", choices=("ps", "sync"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cases", default="ps,ps_straggler,sync,sync_straggler")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.job:
        _job(args.job, args.steps, args.warmup, args.batch)
        return 0
    runners = {"ps": (run_ps, False), "ps_straggler": (run_ps, True),
               "sync": (run_sync, False), "sync_straggler": (run_sync, True)}
    cases = args.cases.split(",")
    for run in range(args.runs):
        for case in cases:  # alternated, so a burst of load hits every case alike
            runner, straggler = runners[case]
            before, start = _load(), time.time()
            result = runner(straggler=straggler, steps=args.steps, warmup=args.warmup,
                            batch=args.batch, timeout=args.timeout)
            print(json.dumps({"case": case, "run": run, **result, "load_before": before,
                              "load_after": _load(), "wall_s": round(time.time() - start, 1)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
