"""Tests for `tfdp.pipelines.sharding`: the shard plan and the step arithmetic."""

import pytest

from tfdp.pipelines import sharding
from tfdp.pipelines import source as source_lib


def _plan(policy="auto", **overrides):
    arguments = dict(
        num_pipelines=2, total=100, context_sizes=None, shards_by_file=True,
        num_files=None, examples_per_step=10, drop_remainder=True, source_name="src",
    )
    arguments.update(overrides)
    return sharding.plan_sharding(policy, **arguments)


def test_element_shard_sizes_match_dataset_shard():
    assert sharding.element_shard_sizes(10, 3) == [4, 3, 3]
    assert sharding.element_shard_sizes(2, 3) == [1, 1, 0]
    assert sharding.element_shard_sizes(source_lib.INFINITE, 2) == [source_lib.INFINITE] * 2


def test_steps_drop_takes_the_smallest_pipeline_and_pad_the_largest():
    assert sharding.steps_per_epoch([25, 24], examples_per_step=10, drop_remainder=True) == 2
    assert sharding.steps_per_epoch([25, 24], examples_per_step=10, drop_remainder=False) == 3
    assert sharding.steps_per_epoch([5, source_lib.INFINITE], examples_per_step=4,
                                    drop_remainder=True) is None


@pytest.mark.parametrize("num_pipelines", [1, 2, 3, 4, 8])
def test_element_sharding_loses_less_than_one_global_batch(num_pipelines):
    # The accounting rule, for every size: training drops only the
    # final partial global batch; evaluation adds less than one global batch
    # of padding steps.
    for per_pipeline_step in (1, 3, 8):
        global_batch = per_pipeline_step * num_pipelines
        for total in range(global_batch, 300):
            sizes = sharding.element_shard_sizes(total, num_pipelines)
            assert sum(sizes) == total
            steps = sharding.steps_per_epoch(
                sizes, examples_per_step=per_pipeline_step, drop_remainder=True
            )
            assert 0 <= total - steps * global_batch < global_batch, (total, num_pipelines)
            steps = sharding.steps_per_epoch(
                sizes, examples_per_step=per_pipeline_step, drop_remainder=False
            )
            assert 0 <= steps * global_batch - total < global_batch, (total, num_pipelines)


def test_one_pipeline_reads_everything():
    plan = _plan(num_pipelines=1, context_sizes=[100])
    assert (plan.mode, plan.sizes) == ("none", (100,))


def test_auto_shards_by_file_when_files_are_balanced():
    plan = _plan(context_sizes=[50, 50], num_files=8)
    assert (plan.mode, plan.sizes) == ("file", (50, 50))
    assert plan.reads_with_context


def test_auto_shards_by_element_when_files_split_unevenly():
    # 3 equal files over 2 pipelines: 66 and 34 examples: 3 steps, not 5.
    plan = _plan(context_sizes=[66, 34], num_files=3)
    assert plan.mode == "data" and plan.sizes == (50, 50)
    assert "3 steps instead of 5" in plan.reason


def test_auto_shards_by_element_with_fewer_files_than_pipelines():
    plan = _plan(context_sizes=None, num_files=1)
    assert plan.mode == "data" and "1 file(s) < 2 input pipelines" in plan.reason


def test_auto_shards_by_element_when_the_source_ignores_its_context():
    plan = _plan(context_sizes=[100, 100], shards_by_file=False)
    assert plan.mode == "data" and "every example to every input pipeline" in plan.reason


def test_auto_trusts_a_callable_that_partitions_the_split():
    plan = _plan(context_sizes=[70, 30], shards_by_file=False)
    assert (plan.mode, plan.sizes) == ("context", (70, 30))


def test_overlapping_or_partial_shards_are_an_error():
    with pytest.raises(ValueError, match=r"\[60, 60\] examples, which neither partition its 100"):
        _plan(context_sizes=[60, 60], shards_by_file=False)


def test_file_policy_needs_a_file_backed_source_with_enough_files():
    with pytest.raises(ValueError, match=r"needs a source stored as files"):
        _plan("file", context_sizes=[50, 50], shards_by_file=False)
    with pytest.raises(ValueError, match=r"has 1 file\(s\) for 2 input pipelines"):
        _plan("file", context_sizes=None, num_files=1)
    plan = _plan("file", context_sizes=[66, 34], num_files=3)
    assert (plan.mode, plan.sizes) == ("file", (66, 34))


def test_data_and_off_policies():
    assert _plan("data", context_sizes=[50, 50]).mode == "data"
    plan = _plan("off", context_sizes=[50, 50], num_files=8)
    assert (plan.mode, plan.sizes) == ("off", (100, 100))


def test_unknown_policy_lists_the_choices():
    with pytest.raises(ValueError, match=r"one of 'auto', 'file', 'data', 'off'.*shard_policy='x'"):
        _plan("x")
