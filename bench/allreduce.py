"""Case 5: all-reduce latency and bandwidth against message size and packing.

This module owns the collective micro-benchmark: on N worker processes
(MultiWorkerMirroredStrategy, ring collectives over loopback gRPC) it times
one `ReplicaContext.all_reduce` of a float32 tensor per `tf.function` call,
for message sizes from 4 B to 40 MB, and a batch all-reduce of the two
benchmark models' gradient lists (the CNN's 1.15 MB in 14 tensors, the MLP's
40 MB in 8) with several `bytes_per_pack` values. Beside each size it puts
the ring all-reduce's bandwidth lower bound, 2(n−1)/n · S / B: a ring moves
2(n−1)/n of the message through every link. B is the link bandwidth: given
(`link_gbytes_per_second`), or measured as the bus bandwidth of the largest
message, where latency matters least.
"""

from __future__ import annotations

import statistics
import time

from tfdp.bench import procs

#: Message sizes in bytes: 4 B .. 40 MB.
DEFAULT_SIZES = (4, 400, 4_000, 40_000, 400_000, 4_000_000, 40_000_000)
#: `bytes_per_pack` values for the gradient-list all-reduces (0: one pack).
DEFAULT_PACKS = (0, 262_144, 4_194_304)


def _iterations(size: int, budget: int) -> int:
    """More calls for small messages (cheap, noisy), fewer for large ones."""
    return max(3, min(budget, int(budget * 400_000 / max(size, 400_000))))


def _gradient_shapes(name: str):
    from tfdp.bench import workloads

    model = workloads.build_cnn() if name == "cnn" else workloads.build_mlp()
    return [tuple(v.shape) for v in model.trainable_variables]


def measure(spec: dict) -> dict:
    """Times all-reduces on this job's workers (a `tfdp.bench.worker` job).

    Args:
        spec: optionally `sizes` (bytes, default `DEFAULT_SIZES`),
            `bytes_per_pack` (default `DEFAULT_PACKS`), `iterations` (calls
            timed per small message, default 30; large messages get fewer).

    Returns:
        `{"num_workers", "sizes": [{"bytes", "seconds" (median), "samples"}],
        "packs": [{"model", "bytes", "tensors", "bytes_per_pack", "seconds"}]}`.
    """
    import tensorflow as tf
    import tfdp

    strategy = tfdp.make_strategy("multi_worker", communication="ring")
    budget = spec.get("iterations", 30)
    device = strategy.extended.worker_devices[0]

    def timed(values, options, iterations):
        @tf.function
        def all_reduce(tensors):
            def replica_fn(ts):
                # A tensor without a device has no all-reduce destination.
                with tf.device(device):
                    ts = tf.nest.map_structure(tf.identity, ts)
                context = tf.distribute.get_replica_context()
                return context.all_reduce("SUM", ts, options=options)
            return strategy.run(replica_fn, args=(tensors,))

        for _ in range(2):  # trace, then one untimed call
            all_reduce(values)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            result = all_reduce(values)
            tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(result))
            samples.append(time.perf_counter() - start)
        return samples

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    sizes = []
    for size in spec.get("sizes", DEFAULT_SIZES):
        tensor = tf.ones([max(1, size // 4)], tf.float32)
        samples = timed(tensor, options, _iterations(size, budget))
        sizes.append({"bytes": size, "seconds": statistics.median(samples), "samples": samples})
    packs = []
    for model in ("cnn", "mlp"):
        tensors = [tf.ones(shape, tf.float32) for shape in _gradient_shapes(model)]
        total = sum(int(t.shape.num_elements()) * 4 for t in tensors)
        for bytes_per_pack in spec.get("bytes_per_pack", DEFAULT_PACKS):
            pack_options = tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=bytes_per_pack,
                implementation=tf.distribute.experimental.CommunicationImplementation.RING,
            )
            samples = timed(tensors, pack_options, _iterations(total, budget))
            packs.append({"model": model, "bytes": total, "tensors": len(tensors),
                          "bytes_per_pack": bytes_per_pack,
                          "seconds": statistics.median(samples)})
    return {"num_workers": strategy.num_replicas_in_sync, "sizes": sizes, "packs": packs}


def ring_lower_bound(size: int, num_workers: int, link_bytes_per_second: float) -> float:
    """Seconds a ring all-reduce of `size` bytes needs at least: 2(n−1)/n · S / B."""
    return 2 * (num_workers - 1) / num_workers * size / link_bytes_per_second


def run(*, nproc: int = 2, sizes=DEFAULT_SIZES, bytes_per_pack=DEFAULT_PACKS,
        iterations: int = 30, link_gbytes_per_second: float | None = None,
        threads: int | None = 1, timeout: float = 300.0) -> dict:
    """Runs the all-reduce case on `nproc` workers and adds the ring lower bound.

    Args:
        nproc: worker processes (>= 2).
        sizes: message sizes, in bytes.
        bytes_per_pack: packing values for the gradient-list all-reduces.
        iterations: calls timed per small message.
        link_gbytes_per_second: link bandwidth B for the lower bound, in GB/s;
            `None` (default) measures it from the largest message.
        threads: TensorFlow intra-/inter-op threads per worker.
        timeout: seconds for the job.

    Returns:
        The case's result: per-size latency, algorithm and bus bandwidth, the
        lower bound and the ratio to it; the packing table.

    Raises:
        ValueError: `nproc` < 2.
        procs.JobFailed: the job failed.
    """
    if nproc < 2:
        raise ValueError(f"`nproc` must be at least 2 to all-reduce. Received: nproc={nproc}")
    measured = procs.run_job(
        "all_reduce",
        {"sizes": list(sizes), "bytes_per_pack": list(bytes_per_pack),
         "iterations": iterations, "threads": threads},
        nproc=nproc, timeout=timeout,
    )
    n = measured["num_workers"]
    factor = 2 * (n - 1) / n
    largest = max(measured["sizes"], key=lambda row: row["bytes"])
    if link_gbytes_per_second is None:
        link = factor * largest["bytes"] / largest["seconds"]
        link_source = f"bus bandwidth of the {largest['bytes']:,} B message"
    else:
        link = link_gbytes_per_second * 1e9
        link_source = "given"
    rows = []
    for row in measured["sizes"]:
        bound = ring_lower_bound(row["bytes"], n, link)
        rows.append({
            "bytes": row["bytes"],
            "seconds": row["seconds"],
            "algorithm_gbytes_per_second": row["bytes"] / row["seconds"] / 1e9,
            "bus_gbytes_per_second": factor * row["bytes"] / row["seconds"] / 1e9,
            "ring_lower_bound_seconds": bound,
            "ratio_to_bound": row["seconds"] / bound,
        })
    return {
        "status": "ok",
        "num_workers": n,
        "implementation": "MultiWorkerMirroredStrategy, ring, loopback gRPC",
        "link_gbytes_per_second": link / 1e9,
        "link_source": link_source,
        "latency_seconds": min(measured["sizes"], key=lambda r: r["bytes"])["seconds"],
        "rows": rows,
        "packs": measured["packs"],
    }
