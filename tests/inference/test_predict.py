"""`tfdp.predict` and `tfdp.read_predictions` in one process: reference checks
against Keras' own `model.predict`, resume, identity and refusals.

The multi-worker paths (two processes, a killed worker) are in
`tests/app/test_predict_cli.py`.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.pipelines import digits as digits_lib
from tfdp.inference import shard_store
from tfdp.inference.shard_store import OutputDirError

FORMATS = ["tfrecord", "npz", "parquet"]


@pytest.fixture(scope="module")
def digits():
    """All 1,797 digits (not a multiple of any batch used here), as (N, 8, 8, 1) float32."""
    return (digits_lib.load_arrays()[0][..., None] / 16.0).astype("float32")


def _model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(7)
    return _model().get_weights()


@pytest.fixture
def two_replicas(weights):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = _model()
    model.set_weights(weights)
    return model, strategy


@pytest.fixture
def one_device(weights):
    model = _model()
    model.set_weights(weights)
    return model


def _files(directory):
    """{relative path: (inode, mtime_ns, size)} of every file under `directory`."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            stat = os.stat(path)
            found[os.path.relpath(path, directory)] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("output_format", FORMATS)
def test_two_replicas_score_every_example_once_as_keras_predict_does(
    tmp_path, digits, two_replicas, one_device, output_format
):
    model, strategy = two_replicas
    summary = tfdp.predict(
        model, tf.data.Dataset.from_tensor_slices(digits), output_dir=str(tmp_path),
        strategy=strategy, batch_size=64, shard_size=256, output_format=output_format, verbose=0,
    )
    assert summary.complete and summary.num_shards == 8 and summary.examples_scored == 1797
    expected = one_device.predict(digits, batch_size=100, verbose=0)

    result = tfdp.read_predictions(str(tmp_path), as_numpy=True)
    assert sorted(result) == ["id", "predictions"]
    np.testing.assert_array_equal(result["id"], np.arange(1797))
    np.testing.assert_allclose(result["predictions"], expected, atol=1e-5)

    rows = list(tfdp.read_predictions(str(tmp_path)).as_numpy_iterator())
    assert [row["id"] for row in rows] == list(range(1797))
    np.testing.assert_array_equal(np.stack([row["predictions"] for row in rows]),
                                  result["predictions"])
    # Files are named by worker and shard; the index is there.
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("part-")) == [
        f"part-00000-{s:05d}.{output_format}" for s in range(8)
    ]


@pytest.mark.slow
def test_one_device_writes_what_two_replicas_write(tmp_path, digits, two_replicas, one_device):
    source = tf.data.Dataset.from_tensor_slices(digits)
    model, strategy = two_replicas
    tfdp.predict(model, source, output_dir=str(tmp_path / "two"), strategy=strategy,
                 batch_size=64, verbose=0)
    tfdp.predict(one_device, source, output_dir=str(tmp_path / "one"), batch_size=64, verbose=0)
    two = tfdp.read_predictions(str(tmp_path / "two"), as_numpy=True)
    one = tfdp.read_predictions(str(tmp_path / "one"), as_numpy=True)
    np.testing.assert_allclose(two["predictions"], one["predictions"], atol=1e-6)


def _counting(calls):
    """A preprocess function that counts the examples it is applied to."""

    def count():
        calls.append(1)
        return np.float32(0)

    def preprocess(image):
        return image + tf.reshape(tf.numpy_function(count, [], tf.float32), [])

    return preprocess


@pytest.mark.slow
def test_rerun_scores_only_the_unfinished_shards_and_leaves_the_others_untouched(
    tmp_path, digits, two_replicas
):
    model, strategy = two_replicas
    source = tf.data.Dataset.from_tensor_slices(digits)
    out = str(tmp_path)
    calls = []
    tfdp.predict(model, source, output_dir=out, strategy=strategy, batch_size=64,
                 shard_size=256, preprocess=_counting(calls), verbose=0)
    assert len(calls) == 1797
    before = tfdp.read_predictions(out, as_numpy=True)

    # What a worker killed while writing shard 5 leaves: its entry was never
    # written, the data file is still under its temporary name; and shard 7's
    # file was renamed but its entry not yet written. No index.
    os.remove(os.path.join(out, "index.json"))
    os.remove(os.path.join(out, "entries", "00005.json"))
    os.replace(os.path.join(out, "part-00000-00005.tfrecord"),
               os.path.join(out, ".part-00000-00005.tfrecord.tmp-123-abc"))
    os.remove(os.path.join(out, "entries", "00007.json"))
    with pytest.raises(ValueError, match="not complete: 6 of 8 shards"):
        tfdp.read_predictions(out)
    kept = {name: stat for name, stat in _files(out).items()
            if name.startswith("part-") and not name.endswith(("00005.tfrecord", "00007.tfrecord"))}
    assert len(kept) == 6

    calls.clear()
    summary = tfdp.predict(model, source, output_dir=out, strategy=strategy, batch_size=64,
                           preprocess=_counting(calls), verbose=0)
    # Shard 5 (256 examples) and the last, shorter shard 7 (1797 - 7 * 256 = 5).
    assert (summary.shards_found_complete, summary.shards_scored) == (6, 2)
    assert len(calls) == 256 + 5, "examples of complete shards were preprocessed again"
    after = _files(out)
    assert {name: after[name] for name in kept} == kept
    assert not [name for name in after if ".tmp-" in name]
    again = tfdp.read_predictions(out, as_numpy=True)
    np.testing.assert_array_equal(again["predictions"], before["predictions"])

    calls.clear()
    summary = tfdp.predict(model, source, output_dir=out, strategy=strategy, batch_size=64,
                           preprocess=_counting(calls), verbose=0)
    assert summary.complete and summary.shards_scored == 0 and not calls


@pytest.mark.slow
def test_key_field_and_named_outputs(tmp_path, digits):
    pixels = keras.Input((8, 8, 1), name="pixels")
    flat = keras.layers.Flatten()(pixels)
    model = keras.Model(pixels, {"logits": keras.layers.Dense(10)(flat),
                                 "embedding": keras.layers.Dense(3)(flat)})
    uids = np.array([f"img-{i:04d}".encode() for i in range(len(digits))])
    source = tf.data.Dataset.from_tensor_slices({"pixels": digits, "uid": uids})
    tfdp.predict(model, source, output_dir=str(tmp_path), key="uid", batch_size=50, verbose=0)
    result = tfdp.read_predictions(str(tmp_path), as_numpy=True)
    assert sorted(result) == ["embedding", "id", "key", "logits"]
    assert list(result["key"]) == list(uids)
    expected = model.predict(digits, verbose=0)
    np.testing.assert_allclose(result["logits"], expected["logits"], atol=1e-5)
    assert result["embedding"].shape == (1797, 3)


def test_labels_in_the_input_are_ignored_as_keras_predict_ignores_them(tmp_path, digits, one_device):
    labels = digits_lib.load_arrays()[1].astype("int64")
    tfdp.predict(one_device, tf.data.Dataset.from_tensor_slices((digits, labels)),
                 output_dir=str(tmp_path), verbose=0)
    result = tfdp.read_predictions(str(tmp_path), as_numpy=True)
    np.testing.assert_allclose(result["predictions"], one_device.predict(digits, verbose=0),
                               atol=1e-5)


def test_another_model_is_refused_and_nothing_changes(tmp_path, digits, one_device):
    source = tf.data.Dataset.from_tensor_slices(digits[:300])
    tfdp.predict(one_device, source, output_dir=str(tmp_path), verbose=0)
    before = _files(tmp_path)
    other = _model()
    with pytest.raises(OutputDirError, match="holds predictions of another run: model"):
        tfdp.predict(other, source, output_dir=str(tmp_path), verbose=0)
    with pytest.raises(OutputDirError, match="num_examples 300 there vs 200 now"):
        tfdp.predict(one_device, source.take(200), output_dir=str(tmp_path), verbose=0)
    assert _files(tmp_path) == before


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, digits, two_replicas):
    model, strategy = two_replicas
    source = tf.data.Dataset.from_tensor_slices(digits[:100])
    out = tmp_path / "out"
    cases = [
        (dict(batch_size=33), ValueError, "multiple of the 2 replica"),
        (dict(output_format="csv"), ValueError, "output_format"),
        (dict(key="uid"), ValueError, "names no feature"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            tfdp.predict(model, source, output_dir=str(out), strategy=strategy, verbose=0, **kwargs)
    with pytest.raises(ValueError, match=r"shape \(4, 4, 1\), but the model expects \(8, 8, 1\)"):
        tfdp.predict(model, tf.data.Dataset.from_tensor_slices(digits[:10, :4, :4]),
                     output_dir=str(out), strategy=strategy, verbose=0)
    with pytest.raises(ValueError, match="endless"):
        tfdp.predict(model, source.repeat(), output_dir=str(out), strategy=strategy, verbose=0)
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        tfdp.predict(model, digits, output_dir=str(out), strategy=strategy, verbose=0)
    assert not [f for f in _files(out) if f.startswith(("part-", "run.json"))]
    with pytest.raises(OutputDirError, match="not writable"):
        (tmp_path / "a_file").write_text("x")
        tfdp.predict(model, source, output_dir=str(tmp_path / "a_file" / "out"),
                     strategy=strategy, verbose=0)


def test_reading_fails_on_a_missing_or_changed_shard(tmp_path, digits, one_device):
    with pytest.raises(FileNotFoundError, match="holds no predictions"):
        tfdp.read_predictions(str(tmp_path))
    tfdp.predict(one_device, tf.data.Dataset.from_tensor_slices(digits[:200]),
                 output_dir=str(tmp_path), shard_size=64, output_format="npz", verbose=0)
    with open(tmp_path / "part-00000-00001.npz", "ab") as f:
        f.write(b"extra")
    with pytest.raises(ValueError, match="part-00000-00001.npz.*missing or was changed"):
        tfdp.read_predictions(str(tmp_path))


def test_the_index_is_written_last_and_lists_every_shard(tmp_path, digits, one_device):
    tfdp.predict(one_device, tf.data.Dataset.from_tensor_slices(digits[:130]),
                 output_dir=str(tmp_path), shard_size=64, verbose=0,
                 model_identity={"name": "tiny"})
    index = shard_store.ShardStore(str(tmp_path), "tfrecord").read_index()
    assert index["num_examples"] == 130 and index["model"]["name"] == "tiny"
    assert [(s["first"], s["count"]) for s in index["shards"]] == [(0, 64), (64, 64), (128, 2)]
    assert index["columns"] == {"id": {"dtype": "int64", "shape": []},
                                "predictions": {"dtype": "float32", "shape": [10]}}
    index_time = os.stat(tmp_path / "index.json").st_mtime_ns
    assert all(os.stat(tmp_path / s["file"]).st_mtime_ns <= index_time for s in index["shards"])


@pytest.mark.slow
def test_an_input_of_unknown_size_is_counted_once_whatever_its_shapes(tmp_path):
    # Rows of different lengths (padded by preprocess), behind a filter: the
    # size is unknown, and the raw examples cannot be batched densely.
    raw = tf.data.Dataset.range(1000).map(lambda i: tf.range(i % 5, dtype=tf.float32))
    raw = raw.filter(lambda row: tf.size(row) != 3)
    assert int(raw.cardinality()) == tf.data.UNKNOWN_CARDINALITY

    def pad(row):
        return tf.ensure_shape(tf.pad(row, [[0, 4 - tf.size(row)]]), [4])

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    summary = tfdp.predict(model, raw, output_dir=str(tmp_path), preprocess=pad, verbose=0)
    assert summary.num_examples == 800
    result = tfdp.read_predictions(str(tmp_path), as_numpy=True)
    expected = model.predict(np.stack(list(raw.map(pad).as_numpy_iterator())), verbose=0)
    np.testing.assert_allclose(result["predictions"], expected, atol=1e-6)
