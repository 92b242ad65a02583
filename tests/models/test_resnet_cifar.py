"""The CIFAR ResNets: depth rule, stages and parameter counts (He et al., 2016)."""

import pytest

from tfdp import models
from tfdp.models import resnet_cifar


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, params_millions",
    # Table 6 of the paper (option A shortcuts); projections add 0.003M.
    [("resnet20", 0.27), ("resnet32", 0.46), ("resnet56", 0.85)],
)
def test_parameter_counts_match_the_paper(name, params_millions):
    model = models.get(name, input_shape=(32, 32, 3), num_classes=10)
    assert model.count_params() / 1e6 == pytest.approx(params_millions, abs=0.015)


def test_layers_with_weights_equal_the_depth():
    model = models.get("resnet20", input_shape=(32, 32, 3), num_classes=10)
    convs = [l for l in model.layers if l.name.endswith("_conv") and "shortcut" not in l.name]
    assert len(convs) + 1 == 20  # ... plus the classifier.
    # Three stages: 32x32x16 -> 16x16x32 -> 8x8x64.
    shapes = [model.get_layer(f"stage{s}_block1_out").output.shape[1:] for s in (1, 2, 3)]
    assert shapes == [(32, 32, 16), (16, 16, 32), (8, 8, 64)]


@pytest.mark.parametrize("depth, blocks", [(8, 1), (20, 3), (56, 9), (110, 18)])
def test_check_depth_returns_blocks_per_stage(depth, blocks):
    assert resnet_cifar.check_depth(depth) == blocks


@pytest.mark.parametrize("depth", [21, 18, 2, 0, -4, 20.0, "20", True])
def test_depth_must_be_6n_plus_2(depth):
    with pytest.raises(ValueError, match=r"`depth` of a CIFAR ResNet must be 6n \+ 2.*"
                                         r"8, 14, 20, 32.*Received: depth="):
        resnet_cifar.resnet_cifar(depth=depth, input_shape=(32, 32, 3), num_classes=10)


def test_any_valid_depth_builds():
    model = resnet_cifar.resnet_cifar(depth=14, input_shape=(8, 8, 1), num_classes=4)
    assert model.name == "resnet14" and model.output_shape == (None, 4)
