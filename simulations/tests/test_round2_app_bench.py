"""The issue-59 benches' own logic: the round-2 exchange's averaging and zero-epoch identity, the app bench's table."""

import torch

from simulations.bench import app_oneshot, fmnist_round2


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))


def test_round2_exchange_with_no_local_epochs_returns_the_start_and_averages_by_weight():
    start = _tiny()
    clients = [{"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))} for _ in range(2)]
    for loss in ("plain", "kd"):
        cfg = {"loss": loss, "epochs": 0, "lr": 0.1, "beta": 1.0, "tau": 4.0}
        out = fmnist_round2.second_exchange(start, clients, [_tiny(), _tiny()], [0.25, 0.75], cfg, seed=0)
        for k, v in start.state_dict().items():
            assert torch.allclose(out.state_dict()[k], v)
    a, b = _tiny().state_dict(), {k: v + 1.0 for k, v in _tiny().state_dict().items()}
    mixed = fmnist_round2.averaged(start, [a, b], [0.25, 0.75]).state_dict()
    assert all(torch.allclose(mixed[k], a[k] + 0.75) for k in a)


def test_round2_kd_step_moves_the_student_towards_the_teacher():
    torch.manual_seed(1)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    teacher = _tiny()
    with torch.no_grad():
        teacher[1].weight.mul_(5)
    with torch.no_grad():
        probs = (teacher(x) / 2.0).softmax(1)
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    kl = lambda m: float(torch.nn.functional.kl_div((m(x) / 2.0).log_softmax(1), probs, reduction="batchmean"))  # noqa: E731
    before = kl(student)
    fmnist_round2.local_round(student, x, y, epochs=20, lr=0.05, seed=0, teacher=probs.__getitem__, beta=1.0, tau=2.0)
    assert kl(student) < 0.5 * before


def test_app_table_pairs_per_seed():
    rows = [{"alpha": 0.5, "seed": s, "fusion-set-size": 2000, "chose": "kf-linear", "fused": 0.7, "with-head": h,
             "best-client": 0.8, "mean-client": 0.6, "ensemble": e, "average": 0.1, "kd": 0.75, "feddf": 0.76}
            for s, h, e in ((0, 0.84, 0.86), (1, 0.82, 0.80))]
    text = app_oneshot.table(rows)
    assert "| clients' ensemble (by samples) | -0.0 ± 2.8 (n=2) [-2.0, +2.0] |" in text
    assert "| best client | +3.0 ± 1.4 (n=2) [+4.0, +2.0] |" in text
    assert "fusion-set-size [2000]" in text
