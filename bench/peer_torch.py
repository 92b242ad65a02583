"""Case 3: the same CNN trained with PyTorch DistributedDataParallel, on CPU.

This module owns the peer measurement: PyTorch DDP over gloo
(`torch.distributed` with `init_method="tcp://127.0.0.1:PORT"`), one process
per worker started by the same launcher as tfdp's workers (ranks from
`TFDP_RANK` / `TFDP_WORLD_SIZE`), each with `torch.set_num_threads(threads)`
and one inter-op thread. The network is built from
`tfdp.bench.workloads.CNN_LAYERS` (same layers, shapes, padding and strides
as the Keras model), trained with SGD (momentum 0.9) and cross-entropy on
logits, on in-memory random batches of the same per-replica size, timed in
`repeats` rounds of `steps` steps after a warm-up round. When PyTorch is not
installed the case is skipped with the reason (`pip install -e ".[bench]"`).

PyTorch runs at its own best CPU settings: the model and the images in
`channels_last` (its convolutions on CPU are fastest so; `channels_last=False`
gives NCHW, as the measurements before 2026-11-25 used). `hook` registers
one of DDP's communication hooks, PyTorch's counterparts of tfdp's
`gradient_compression`: `"fp16"` (`default_hooks.fp16_compress_hook`: half the bytes; its
`bf16_compress_hook` refuses to run without CUDA 11+ and NCCL 2.10+) or
`"powersgd"` (`powerSGD_hook` with `PowerSGDState(matrix_approximation_rank=
rank, start_powerSGD_iter=2, min_compression_rate=2)`, error feedback and warm
start on; PyTorch needs at least 2 uncompressed iterations with them, which
the warm-up round covers), or `"local_sgd"`: PyTorch's post-local SGD, the
counterpart of tfdp's `sync_every` (`post_localSGD_hook` from step 0 with
`post_local_gradient_allreduce=False`, so no gradient is exchanged, and
`PostLocalSGDOptimizer` with a `PeriodicModelAverager(period)`, which
all-reduces the parameters every `period` steps; like tfdp's local SGD it
never averages the momentum buffers). PyTorch's averager counts from 0, so
it averages after steps 1, 1 + period, ... where tfdp syncs after steps
period, 2 period, ...: the same bytes per step, a window's phase apart.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time

from tfdp.bench import procs

_DEFAULTS = {"per_replica_batch": 64, "steps": 100, "repeats": 3, "threads": 1,
             "channels_last": True, "hook": "none", "rank": 4, "period": 8}
#: DDP communication hooks `measure` can register (see the module docstring).
HOOKS = ("none", "fp16", "powersgd", "local_sgd")


def torch_missing_reason() -> str | None:
    """Why the case cannot run here, or None when PyTorch is importable."""
    if importlib.util.find_spec("torch") is None:
        return ('PyTorch is not installed; install the benchmark extra '
                '(pip install -e ".[bench]") to compare with PyTorch DDP.')
    return None


def build_torch_cnn():
    """The benchmark CNN (`workloads.CNN_LAYERS`) as a `torch.nn.Sequential` (NCHW)."""
    from torch import nn

    from tfdp.bench import workloads

    layers, channels = [], workloads.IMAGE_SHAPE[2]
    for layer in workloads.CNN_LAYERS:
        # padding=1 with a 3x3 kernel: Keras' "same" output size at stride 1 and 2.
        layers += [nn.Conv2d(channels, layer.filters, 3, stride=layer.stride, padding=1),
                   nn.ReLU()]
        channels = layer.filters
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, workloads.NUM_CLASSES)]
    return nn.Sequential(*layers)


def measure(spec: dict) -> dict:
    """Times DDP training on this launch's workers (a `tfdp.bench.worker` job).

    Args:
        spec: `port` (the rendezvous port), and optionally `per_replica_batch`
            (64), `steps` (100), `repeats` (3), `threads` (1), `channels_last`
            (True), `hook` (one of `HOOKS`, "none"), `rank` (4, for
            "powersgd") and `period` (8, for "local_sgd").

    Returns:
        `{"world_size", "global_batch", "images_per_second" (best),
        "median_images_per_second", "step_ms", "samples", "parameters"}`.
    """
    spec = {**_DEFAULTS, **spec}
    import torch
    import torch.distributed as dist

    from tfdp.bench import workloads

    rank, world = join_gloo_group(spec["threads"], spec["port"])
    try:
        torch.manual_seed(0)
        memory_format = torch.channels_last if spec["channels_last"] else torch.contiguous_format
        model = wrap_ddp(build_torch_cnn().to(memory_format=memory_format), spec["hook"],
                         spec["rank"])
        optimizer = make_optimizer(model, spec["hook"], lr=0.01, momentum=0.9,
                                   period=spec["period"])
        loss_fn = torch.nn.CrossEntropyLoss()
        batch = spec["per_replica_batch"]
        height, width, channels = workloads.IMAGE_SHAPE
        generator = torch.Generator().manual_seed(rank)
        data = [(torch.randn(batch, channels, height, width, generator=generator
                             ).contiguous(memory_format=memory_format),
                 torch.randint(0, workloads.NUM_CLASSES, (batch,), generator=generator))
                for _ in range(4)]

        def run(steps):
            for step in range(steps):
                x, y = data[step % len(data)]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()

        run(spec["steps"])  # warm-up
        samples = []
        for _ in range(spec["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            run(spec["steps"])
            samples.append(spec["steps"] * batch * world / (time.perf_counter() - start))
        parameters = sum(p.numel() for p in model.parameters())
        # Every rank is done with gloo before any tears it down: a rank still
        # talking to rank 0's store when rank 0 destroys the group aborted
        # ("terminate called without an active exception", exit 134).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "world_size": world,
        "per_replica_batch": batch,
        "global_batch": batch * world,
        "parameters": parameters,
        "torch_version": torch.__version__,
        "hook": spec["hook"],
        **({"period": spec["period"]} if spec["hook"] == "local_sgd" else {}),
        "channels_last": spec["channels_last"],
        "images_per_second": max(samples),
        "median_images_per_second": statistics.median(samples),
        "step_ms": 1000.0 * batch * world / statistics.median(samples),
        "samples": samples,
    }


def join_gloo_group(threads: int, port: int) -> tuple[int, int]:
    """Limits torch to `threads` threads and joins this launch's gloo group: `(rank, world)`.

    The rank and world size come from the launcher (`TFDP_RANK`,
    `TFDP_WORLD_SIZE`), the rendezvous from rank 0 at 127.0.0.1:`port`.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    rank = int(os.environ.get("TFDP_RANK", "0"))
    world = int(os.environ.get("TFDP_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    return rank, world


def wrap_ddp(module, hook: str, rank: int):
    """`module` in DistributedDataParallel with the communication hook `hook` registered."""
    from torch.nn.parallel import DistributedDataParallel

    # powerSGD_hook chains its collectives through future callbacks, which
    # run on whichever thread completes the previous one: with two buckets
    # in flight the ranks' orders can differ (gloo then fails with
    # "Received data size doesn't match expected size"). One bucket,
    # first included (bucket_cap_mb_list), keeps one chain.
    buckets = {"bucket_cap_mb_list": [64, 64]} if hook == "powersgd" else {}
    model = DistributedDataParallel(module, **buckets)
    register_hook(model, hook, rank)
    return model


def register_hook(model, hook: str, rank: int) -> None:
    """Registers DDP's communication hook `hook` (one of `HOOKS`) on `model`, PowerSGD at `rank`."""
    if hook not in HOOKS:
        raise ValueError(f"`hook` must be one of {', '.join(HOOKS)}. Received: hook={hook!r}")
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
            min_compression_rate=2, use_error_feedback=True, warm_start=True,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook == "local_sgd":  # no gradient exchange; make_optimizer's averager syncs
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=0,
            post_local_gradient_allreduce=False)
        model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)


def make_optimizer(model, hook: str, *, lr: float, momentum: float, period: int):
    """SGD with momentum on `model`'s parameters; for `hook="local_sgd"` wrapped in
    `PostLocalSGDOptimizer`, which averages the parameters every `period` steps."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if hook != "local_sgd":
        return optimizer
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer

    return PostLocalSGDOptimizer(
        optim=optimizer, averager=averagers.PeriodicModelAverager(period=period, warmup_steps=0))


def run(*, workers=(1, 2), per_replica_batch: int = 64, steps: int = 100, repeats: int = 3,
        threads: int = 1, timeout: float = 300.0, hook: str = "none", rank: int = 4,
        channels_last: bool = True, period: int = 8) -> dict:
    """Runs the peer case: one DDP launch per worker count, or a skip record.

    Args:
        workers: worker counts to measure.
        per_replica_batch: examples per process per step.
        steps: steps per timed round.
        repeats: timed rounds.
        threads: `torch.set_num_threads` per process.
        timeout: seconds per launch.
        hook, rank, channels_last, period: see `measure`.

    Returns:
        `{"status": "ok", "workers": {n: measurement}}`, or
        `{"status": "skipped", "reason": ...}` without PyTorch.

    Raises:
        procs.JobFailed: a launch failed.
    """
    reason = torch_missing_reason()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    results = {}
    for n in workers:
        spec = {"per_replica_batch": per_replica_batch, "steps": steps, "repeats": repeats,
                "threads": threads, "port": procs.free_port(), "hook": hook, "rank": rank,
                "channels_last": channels_last, "period": period}
        results[str(n)] = procs.run_job("torch_ddp", spec, nproc=n, timeout=timeout)
    return {"status": "ok", "framework": "PyTorch DDP, gloo, CPU", "workers": results}


def compare(peer: dict, runs: dict | None, *, paths=("tfdp_fit", "trainer")) -> dict:
    """Adds tfdp's throughput over PyTorch DDP's, per worker count, to `peer`.

    Args:
        peer: `run`'s result.
        runs: `tfdp.bench.throughput.run`'s result (same CNN, batch and
            threads), or None.
        paths: tfdp paths to compare.

    Returns:
        `peer` plus `"torch_efficiency"` (DDP's scaling efficiency) and
        `"tfdp_over_torch": {n: {path: ratio}}`.
    """
    if peer.get("status") != "ok":
        return peer
    workers = peer["workers"]
    result = dict(peer)
    if "1" in workers:
        base = workers["1"]["images_per_second"]
        result["torch_efficiency"] = {
            n: row["images_per_second"] / (int(n) * base) for n, row in workers.items()
        }
    if runs:
        result["tfdp_over_torch"] = {
            n: {path: runs[n]["paths"][path]["images_per_second"] / row["images_per_second"]
                for path in paths if n in runs and path in runs[n]["paths"]}
            for n, row in workers.items()
        }
    return result
