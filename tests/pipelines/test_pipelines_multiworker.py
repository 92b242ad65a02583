"""`make_dataset` under MultiWorkerMirroredStrategy: 2 real worker processes.

Each worker iterates its distributed dataset in a custom loop that, like
Keras's epoch iterator, runs as many steps as the dataset's cardinality says,
with a collective every step: a worker with one step more than the other
would wait in it, and its peer would find data left after its last step.
Each worker writes the ids or example hashes it saw; the test unions the
files: every example exactly once per epoch, the same step count on both
workers. Both workers also prepare the digits dataset into the same fresh
directory at once. Last, in the same launch, both run Keras' `evaluate` on an
evaluation set whose final step has a partial batch on one worker and an
empty one on the other; its loss and accuracy must equal the single-device
values.
"""

import collections
import hashlib
import json

import keras
import numpy as np
import pytest

from tfdp import pipelines
from multiworker import run_worker_script

WORKER = r'''
import hashlib
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tfdp import pipelines
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

# Keras evaluate: the test's model and data, 37 examples in global batches of 4.
data = np.load(os.path.join(out_dir, "classifier.npz"))
with strategy.scope():
    inputs = keras.Input(data["x"].shape[1:])
    outputs = keras.layers.Dense(data["bias"].shape[0], activation="softmax")(inputs)
    model = keras.Model(inputs, outputs)
    model.set_weights([data["kernel"], data["bias"]])
    model.compile(loss="sparse_categorical_crossentropy",
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
evaluation = pipelines.make_dataset(
    tf.data.Dataset.from_tensor_slices((data["x"], data["y"])), strategy=strategy,
    global_batch=4, training=False,
)
metrics = model.evaluate(evaluation, return_dict=True, verbose=0)
info = evaluation.pipeline_info
results["keras_evaluate"] = dict(
    loss=float(metrics["loss"]), accuracy=float(metrics["accuracy"]),
    steps_per_epoch=info.steps_per_epoch, sizes=list(info.pipeline_sizes),
    partial=info.partial_batches_per_epoch,
)

path = os.path.join(out_dir, f"worker{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(results, f)
os.replace(path + ".tmp", path)
print("done", rank)
'''


def _classifier_and_reference(path):
    """Writes a tiny classifier's weights and 37 examples to `path`.

    Returns:
        The single-device `(loss, accuracy)` on those examples, in float64.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 3)).astype("float32")
    y = rng.integers(0, 4, size=37)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(inputs))
    kernel, bias = model.get_weights()
    np.savez(path, x=x, y=y, kernel=kernel, bias=bias)
    probabilities = model.predict(x, verbose=0).astype("float64")
    loss = np.mean(-np.log(probabilities[np.arange(len(y)), y]))
    accuracy = np.mean(np.argmax(probabilities, axis=1) == y)
    return loss, accuracy


@pytest.mark.slow
def test_two_workers_see_every_example_once_in_equal_steps(tmp_path):
    digits_dir = tmp_path / "tfds"  # Does not exist yet: both workers create it.
    expected_loss, expected_accuracy = _classifier_and_reference(tmp_path / "classifier.npz")
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

    # Keras evaluate over 2 workers equals one device: 37 examples split 19/18,
    # 2 per replica: worker 0 ends with a 1-example batch, worker 1 with an
    # empty one, and nothing is dropped or padded.
    for worker in workers:
        evaluation = worker["keras_evaluate"]
        assert evaluation["sizes"] == [19, 18] and evaluation["steps_per_epoch"] == 10
        assert evaluation["partial"] == 2
        assert evaluation["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)
        assert evaluation["loss"] == pytest.approx(expected_loss, abs=1e-6)
