"""SplitLinear against nn.Linear (forward, gradients) and its checkpoints under the unsplit names."""

import pytest
import torch
from torch import nn

from osdp_planners.split import SplitLinear, slice_sizes, split_linear_in, to_split_names

IN_FEATURES = 12
OUT_FEATURES = (12, 10, 7)  # divisible by 2, 3 and 4; 10 by 2 only; 7 by none
SPLITS = (2, 3, 4)


def _linear(out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(IN_FEATURES, out_features, bias=bias)
    if bias:
        with torch.no_grad():
            linear.bias.normal_()  # nonzero, so a bias lost in a slice would show
    return linear


def test_slice_sizes_cover_the_features_larger_first() -> None:
    assert slice_sizes(10, 4) == [3, 3, 2, 2]
    assert slice_sizes(7, 7) == [1] * 7
    assert sum(slice_sizes(150, 4)) == 150


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", OUT_FEATURES)
@pytest.mark.parametrize("k", SPLITS)
def test_split_linear_matches_linear(k: int, out_features: int, bias: bool) -> None:
    """Same output, input gradient and weight/bias gradients as the Linear it was cut from."""
    linear = _linear(out_features, bias)
    split = SplitLinear.from_linear(linear, k)
    assert [p.out_features for p in split.slices] == slice_sizes(out_features, k)
    x = torch.randn(3, 5, IN_FEATURES)
    upstream = torch.randn(3, 5, out_features)
    x_ref = x.clone().requires_grad_()
    x_split = x.clone().requires_grad_()
    out_ref, out_split = linear(x_ref), split(x_split)
    torch.testing.assert_close(out_split, out_ref)
    (out_ref * upstream).sum().backward()
    (out_split * upstream).sum().backward()
    torch.testing.assert_close(x_split.grad, x_ref.grad)
    torch.testing.assert_close(torch.cat([p.weight.grad for p in split.slices]), linear.weight.grad)
    if bias:
        torch.testing.assert_close(torch.cat([p.bias.grad for p in split.slices]), linear.bias.grad)
    else:
        assert all(p.bias is None for p in split.slices) and split.bias is None


def _model(out_features: int, bias: bool, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, out_features, bias=bias), nn.Tanh(), nn.Linear(out_features, 5, bias=bias)
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [10, 7])
def test_state_dict_round_trip_across_split_factors(out_features: int, bias: bool) -> None:
    """Saved under k=2, loaded into k=4 and into the plain model: same keys, same outputs."""
    plain = _model(out_features, bias, seed=0)
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    saved_model = _model(out_features, bias, seed=0)
    split_linear_in(saved_model, "0", 2)
    split_linear_in(saved_model, "2", 2)
    saved = saved_model.state_dict()
    assert list(saved) == list(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key

    into_split = _model(out_features, bias, seed=1)
    split_linear_in(into_split, "0", 4)
    split_linear_in(into_split, "2", 3)
    into_plain = _model(out_features, bias, seed=2)
    into_split.load_state_dict(saved)
    into_plain.load_state_dict(saved)
    x = torch.randn(4, IN_FEATURES)
    reference = plain(x)
    torch.testing.assert_close(into_split(x), reference)
    assert torch.equal(into_plain(x), reference)
    for key, value in expected.items():
        assert torch.equal(into_split.state_dict()[key], value), key


def test_load_reports_wrong_shape_and_missing_keys() -> None:
    model = _model(10, True, seed=0)
    split_linear_in(model, "0", 2)
    wrong = _model(9, True, seed=0).state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight"):
        model.load_state_dict(wrong)
    partial = {k: v for k, v in _model(10, True, seed=0).state_dict().items() if k != "0.bias"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.slices\.0\.bias"):
        model.load_state_dict(partial)


def test_weight_property_and_split_names() -> None:
    """`.weight` / `.bias` read like nn.Linear's; `to_split_names` maps a full dict to slice keys."""
    plain = _model(7, True, seed=0)
    model = _model(7, True, seed=3)
    split_linear_in(model, "0", 3)
    renamed = to_split_names(model, plain.state_dict())
    assert {k for k in renamed if k.startswith("0.")} == {
        f"0.slices.{i}.{n}" for i in range(3) for n in ("weight", "bias")
    }
    model.load_state_dict(renamed)
    assert torch.equal(model[0].weight, plain[0].weight)
    assert torch.equal(model[0].bias, plain[0].bias)
    assert isinstance(model[0].weight, torch.Tensor) and not isinstance(model[0].weight, nn.Parameter)
