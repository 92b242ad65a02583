"""`tfdp-train` on every registered model x every registered dataset x both loops.

Each pair either trains (one process, one replica, batch 4, 2 steps, no
evaluation) or exits 2 with one line before the strategy is built. All run
in-process (no TensorFlow import per case) through `tfdp.app.train.main`, as
the console script calls it. Every refused pair is run, in both loops (each
costs milliseconds). Of the accepted pairs, `tfdp.app.compatibility.check`
accepts all (test_compatibility.py) and a representative set trains for real
here: the cheapest model on each registered dataset in both loops and a
batch-normalised ResNet; ResNet-50 on the digits resized to 32x32 (the
README's Slurm example) is built and fed a batch. The whole accepted matrix, every ResNet depth on
every image dataset in both loops, trains too but takes about 10 minutes on
2 cores: CI runs it only with TFDP_FULL_MATRIX=1.
"""

import math
import os

import pytest
from absl import flags

from tfdp import models
from tfdp import pipelines
from tfdp.app import compatibility
from tfdp.app import data_description
from tfdp.app import experiment
from tfdp.app import run_config
from tfdp.app import train as train_cli
from tfdp.distribute import strategy as strategy_lib

LOOPS = ("fit", "custom")
TINY_RUN = ("--cpu_replicas=1", "--epochs=1", "--steps_per_epoch=2", "--steps_per_loop=2",
            "--global_batch=4", "--noeval")


def _fits(model, dataset) -> bool:
    data = data_description.describe_before_strategy(run_config.RunConfig(dataset=dataset))
    try:
        compatibility.check(model, data, hints=False)
    except compatibility.IncompatibleError:
        return False
    return True


CASES = [(model, dataset, loop) for dataset in pipelines.known_sources()
         for model in models.names() for loop in LOOPS]
#: The accepted pairs that train for real in every CI run (see the module docstring).
REPRESENTATIVE = {("mlp", "digits", "fit"), ("mlp", "digits", "custom"),
                  ("cnn", "synthetic_images", "fit"), ("cnn", "synthetic_images", "custom"),
                  ("transformer", "synthetic_tokens", "fit"),
                  ("transformer", "synthetic_tokens", "custom"),
                  ("resnet20", "digits", "custom")}
FULL_MATRIX = os.environ.get("TFDP_FULL_MATRIX") == "1"


def test_every_registered_dataset_trains_for_real_in_both_loops():
    for dataset in pipelines.known_sources():
        assert {loop for _, d, loop in REPRESENTATIVE if d == dataset} == set(LOOPS), dataset
    assert all(_fits(model, dataset) for model, dataset, _ in REPRESENTATIVE)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Runs `tfdp-train ARGV`; returns (exit code, stderr lines, summary or None, strategies built)."""
    built = []
    summaries = []
    make_strategy = strategy_lib.make_strategy
    train_and_evaluate = experiment.train_and_evaluate

    def counting_make_strategy(*args, **kwargs):
        built.append(args)
        return make_strategy(*args, **kwargs)

    def keep_summary(*args, **kwargs):
        summaries.append(train_and_evaluate(*args, **kwargs))
        return summaries[-1]

    monkeypatch.setattr(strategy_lib, "make_strategy", counting_make_strategy)
    monkeypatch.setattr(experiment, "train_and_evaluate", keep_summary)

    def run(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["tfdp-train", *argv])
        capsys.readouterr()
        try:
            train_cli.main(["tfdp-train"])
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        return code, err, (summaries[-1] if summaries else None), len(built)

    yield run
    flags.FLAGS.unparse_flags()


@pytest.mark.slow
@pytest.mark.parametrize("model, dataset, loop", CASES)
def test_each_pair_trains_two_steps_or_exits_2_before_any_work(run_cli, model, dataset, loop):
    fits = _fits(model, dataset)
    if fits and not FULL_MATRIX and (model, dataset, loop) not in REPRESENTATIVE:
        pytest.skip("accepted by compatibility.check; trained with TFDP_FULL_MATRIX=1")
    code, err, summary, strategies = run_cli(f"--model={model}", f"--dataset={dataset}",
                                             f"--loop={loop}", *TINY_RUN)
    if fits:
        assert code == 0, err
        assert summary["steps"] == 2
        assert math.isfinite(summary["train"]["loss"])
    else:
        assert code == 2
        assert len(err) == 1 and err[0].startswith("tfdp-train: error: "), err
        assert f"--model={model}" in err[0] and f"--dataset={dataset}" in err[0]
        assert strategies == 0  # refused before the strategy: no runtime, no data, no model


@pytest.mark.slow
def test_resnet50_takes_the_digits_resized_to_32():
    """The README's Slurm example (resnet50 on the default digits) with --image_size=32:
    the pipeline's batches are 32x32x1 and ResNet-50 maps them to logits. (Its 2-step
    training, about a minute on 2 cores, runs with TFDP_FULL_MATRIX=1, as does
    resnet50 on synthetic_images.)"""
    import tensorflow as tf

    from tfdp.training.batch import BatchConfig

    config = run_config.RunConfig(model="resnet50", dataset="digits", image_size=32,
                                  global_batch=4)
    dataset, spec = train_cli._build_dataset(config)(
        experiment.TRAIN, training=True, strategy=tf.distribute.get_strategy(),
        batch=BatchConfig.from_global(4, 1), seed=0)
    # The CLI plans its training split (it streams the epochs); epoch 0 is built on demand.
    images, labels = next(iter(dataset.distribute()))
    assert tuple(images.shape) == (4, 32, 32, 1) and images.dtype == tf.float32
    assert spec.input_shape == (32, 32, 1)
    model = train_cli._build_model(config)("resnet50", input_shape=spec.input_shape,
                                           num_classes=spec.num_classes)
    assert tuple(model(images, training=False).shape) == (4, 10)


@pytest.mark.skipif(not FULL_MATRIX, reason="about a minute on 2 cores; TFDP_FULL_MATRIX=1")
@pytest.mark.parametrize("loop", LOOPS)
def test_resnet50_trains_on_the_digits_resized_to_32(run_cli, loop):
    code, err, summary, _ = run_cli("--model=resnet50", "--dataset=digits", "--image_size=32",
                                    f"--loop={loop}", *TINY_RUN)
    assert code == 0, err
    assert summary["model"]["input_shape"] == [32, 32, 1] and summary["steps"] == 2


@pytest.mark.slow
def test_evaluation_reads_the_padded_eval_split(run_cli):
    """The evaluation data goes through the same padding; the summary names its split."""
    code, err, summary, _ = run_cli(
        "--model=transformer", "--dataset=synthetic_tokens", "--sequence_length=16",
        "--eval", "--eval_split=validation",
        *[flag for flag in TINY_RUN if flag != "--noeval"])
    assert code == 0, err
    assert summary["eval_split"] == "validation"
    assert summary["model"] == {"name": "transformer", "input_shape": [16], "num_classes": 2,
                                "arguments": {"vocab_size": 1000}}
    assert 0 <= summary["eval"]["accuracy"] <= 1
