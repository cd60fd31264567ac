"""Backend.optimize_for_training(model, optimizer): the model prepared for
training and the fastest correct optimizer (torch's fused Adam / AdamW for a
default one), saying what it did (issue 24)."""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tensor_ops.torch import BackendFactory  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("as_keyword", [False, True])
def test_default_adam_becomes_fused_and_trains_the_same(kind, as_keyword):
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = kind(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = kind(model.parameters(), lr=1e-2, weight_decay=0.01)
    b = BackendFactory.create("cpu")
    out = b.optimize_for_training(model, optimizer=opt) if as_keyword else b.optimize_for_training(model, opt)
    model, fused, result = out
    # the same object, switched in place: a scheduler attached to it keeps driving it
    assert model.training and fused is opt and type(fused) is kind
    assert all(g["fused"] for g in fused.param_groups)
    assert any("fused=True" in s for s in result.optimizations_applied), result.optimizations_applied
    x = torch.randn(8, 16)
    for _ in range(5):
        for m, o in ((ref, ref_opt), (model, fused)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_a_scheduler_and_earlier_steps_carry_over():
    """An LR scheduler made before optimize_for_training keeps setting the lr
    of the optimizer that steps (it drove a discarded one: 1e-6 set, 1e-2
    used), and the state of steps taken before carries over."""
    ref, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (ref_opt, opt)]
    x = torch.randn(8, 16)

    def step(m, o, s):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
        s.step()

    for pair in ((ref, ref_opt, scheds[0]), (model, opt, scheds[1])):
        step(*pair)
    groups, group = opt.param_groups, opt.param_groups[0]
    _, fused, _ = BackendFactory.create("cpu").optimize_for_training(model, opt)
    assert fused is opt and fused.param_groups[0]["fused"]
    assert fused.param_groups is groups and fused.param_groups[0] is group  # held references still drive it
    for _ in range(3):
        step(ref, ref_opt, scheds[0])
        step(model, fused, scheds[1])
    assert fused.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_other_optimizers_are_kept_with_the_reason():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, same, result = BackendFactory.create("cpu").optimize_for_training(model, opt)
    assert same is opt
    assert any("kept as given" in s for s in result.optimizations_applied)


def test_without_an_optimizer_the_shape_is_unchanged():
    model, result = BackendFactory.create("cpu").optimize_for_training(_model(), "O1")
    assert model.training and result.success


def test_module_level_optimize_for_training():
    """tensor_ops.torch.optimize_for_training(model, optimizer): the current
    backend's, as users reach for it (it existed only as a Backend method)."""
    import tensor_ops.torch as tt

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    got, same, result = tt.optimize_for_training(model, opt)
    assert got is model and same is opt and opt.defaults.get("fused") and result.success
    got, result = tt.optimize_for_training(model)
    assert result.success
