"""The data-free bench loop (``simulations/bench/fmnist_datafree.py``: DENSE, Co-Boosting) on tiny teachers."""

import torch

from fedfuse.models import build_model
from simulations.bench import fmnist_datafree as D


def test_crop_flip_is_a_shifted_or_flipped_window_of_the_padded_image():
    x = torch.arange(2 * 28 * 28, dtype=torch.float32).view(2, 1, 28, 28)
    out = D.crop_flip(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    p = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for b in range(2):
        windows = [p[b, :, i:i + 28, j:j + 28] for i in range(9) for j in range(9)]
        assert any(torch.equal(out[b], w) or torch.equal(out[b], w.flip(-1)) for w in windows)


def test_generator_makes_images_in_unit_range():
    g = D.Generator(ngf=4)
    g.reset()
    x = g(torch.randn(3, D.NZ))
    assert x.shape == (3, 1, 28, 28) and float(x.min()) >= 0 and float(x.max()) <= 1


def test_both_methods_run_and_coboosting_weights_stay_in_unit_box():
    teachers = [build_model("lenet", 10, (1, 28, 28), seed=k).eval() for k in range(3)]
    before = [t.state_dict()["0.weight"].clone() for t in teachers]
    for method in D.METHODS:
        student, info = D.datafree(teachers, method, seed=0, epochs=2, g_steps=2, ngf=4)
        assert student(torch.zeros(1, 1, 28, 28)).shape == (1, 10)
        assert info["pool"] == 2 * D.METHODS[method]["batch"]
        assert all(0.0 <= w <= 1.0 for w in info["weights"])
    assert all(torch.equal(t.state_dict()["0.weight"], b) for t, b in zip(teachers, before))   # teachers untouched
