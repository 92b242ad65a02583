"""`make_dataset` under MultiWorkerMirroredStrategy: 2 real worker processes.

Each worker iterates its distributed dataset in a custom loop that, like
Keras's epoch iterator, runs as many steps as the dataset's cardinality says,
with a collective every step: a worker with one step more than the other
would wait in it, and its peer would find data left after its last step.
Each worker writes the ids or example hashes it saw; the test unions the
files: every example exactly once per epoch, the same step count on both
workers. Both workers also prepare the digits dataset into the same fresh
directory at once.
"""

import collections
import hashlib
import json

import pytest

import pipelines
from multiworker import run_worker_script

WORKER = r'''
import hashlib
import json
import os
import sys

import tensorflow as tf

import pipelines
import tfdp

out_dir, digits_dir = sys.argv[1], sys.argv[2]
strategy = tfdp.make_strategy("multi_worker", timeout_seconds=30)
rank = int(os.environ["TFDP_RANK"])


@tf.function
def global_count(batch):
    def replica_fn(features, labels):
        return tf.distribute.get_replica_context().all_reduce("sum", tf.shape(labels)[0])
    return strategy.run(replica_fn, args=batch)


def ids_of(features):
    return [int(i) for i in features.numpy()]


def hashes_of(images, labels):
    return [
        hashlib.md5(image.tobytes()).hexdigest() + f"/{label}"
        for image, label in zip(images.numpy(), labels.numpy())
    ]


ids = tf.data.Dataset.range(37).map(lambda i: (i, i % 10))
cases = {
    "train": dict(source=ids, global_batch=4, seed=1),
    "eval": dict(source=ids, global_batch=4, training=False),
    "digits_train": dict(source="digits", data_dir=digits_dir, global_batch=64, seed=1),
    "digits_test": dict(source="digits", split="test", data_dir=digits_dir, global_batch=64,
                        training=False),
}
results = {}
for name, kwargs in cases.items():
    dataset = pipelines.make_dataset(strategy=strategy, **kwargs)
    seen, steps, total = [], 0, 0
    for epoch in range(2 if name == "train" else 1):
        epoch_seen = []
        iterator = iter(dataset)
        for _ in range(int(dataset.cardinality)):  # What Keras takes as steps.
            features, labels = next(iterator)
            total += int(strategy.experimental_local_results(global_count((features, labels)))[0])
            for x, y in zip(strategy.experimental_local_results(features),
                            strategy.experimental_local_results(labels)):
                epoch_seen += ids_of(x) if "digits" not in name else hashes_of(x, y)
            steps += 1
        try:
            next(iterator)
            raise AssertionError(f"{name}: data left after {steps} steps")
        except (StopIteration, tf.errors.OutOfRangeError):
            pass
        seen.append(epoch_seen)
    info = dataset.pipeline_info
    results[name] = dict(
        seen=seen, steps=steps, total=total, steps_per_epoch=info.steps_per_epoch,
        shard_mode=info.shard_mode, dropped=info.dropped_per_epoch,
        num_input_pipelines=info.num_input_pipelines,
    )

path = os.path.join(out_dir, f"worker{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(results, f)
os.replace(path + ".tmp", path)
print("done", rank)
'''


@pytest.mark.slow
def test_two_workers_see_every_example_once_in_equal_steps(tmp_path):
    digits_dir = tmp_path / "tfds"  # Does not exist yet: both workers create it.
    result = run_worker_script(
        tmp_path, WORKER, nproc=2, timeout=240, check=True,
        script_args=[str(tmp_path), str(digits_dir)],
    )
    assert result.worker_stdout(0)[-1] == "done 0" and result.worker_stdout(1)[-1] == "done 1"
    workers = [json.loads((tmp_path / f"worker{r}.json").read_text()) for r in range(2)]

    for name in ("train", "eval", "digits_train", "digits_test"):
        a, b = workers[0][name], workers[1][name]
        assert a["num_input_pipelines"] == 2
        assert a["steps"] == b["steps"], name
        epochs = len(a["seen"])
        assert a["steps"] == a["steps_per_epoch"] * epochs, name
        assert a["total"] == b["total"]
        for epoch in range(epochs):
            union = a["seen"][epoch] + b["seen"][epoch]
            assert len(union) == len(set(union)) or "digits" in name, name
            assert a["total"] == epochs * len(union), name

    # 37 examples, 2 workers x 1 replica, global batch 4: shards of 19 and 18.
    train, evaluation = workers[0]["train"], workers[0]["eval"]
    assert train["steps_per_epoch"] == 9 and train["dropped"] == 1
    for epoch in range(2):
        union = workers[0]["train"]["seen"][epoch] + workers[1]["train"]["seen"][epoch]
        assert len(set(union)) == 36 and set(union) <= set(range(37))
    assert workers[0]["train"]["seen"][0] != workers[0]["train"]["seen"][1]  # Reshuffled.
    # Evaluation: worker 1 runs out first and gets an empty batch in step 10.
    assert evaluation["steps_per_epoch"] == 10
    assert sorted(workers[0]["eval"]["seen"][0] + workers[1]["eval"]["seen"][0]) == list(range(37))

    # Digits: each worker reads its own 4 of the 8 files, every example once.
    source = pipelines.get_source("digits", data_dir=str(digits_dir))
    for split, name in (("train", "digits_train"), ("test", "digits_test")):
        assert workers[0][name]["shard_mode"] == "file"
        seen = collections.Counter(workers[0][name]["seen"][0] + workers[1][name]["seen"][0])
        everything = collections.Counter(
            hashlib.md5(image.tobytes()).hexdigest() + f"/{label}"
            for image, label in source.read(split).as_numpy_iterator()
        )
        if split == "test":
            assert seen == everything and sum(seen.values()) == 360
        else:
            assert not seen - everything  # Nothing seen more often than it exists.
            assert sum(everything.values()) - sum(seen.values()) == workers[0][name]["dropped"] < 64
