"""The FuseFL and FENS benches (``simulations/bench/fmnist_fusefl.py``, ``fmnist_fens.py``) on tiny cases with known
answers."""

import copy

import torch
from torch import nn

from fedfuse.models import build_model
from simulations.bench import fmnist_fens as FE
from simulations.bench import fmnist_fusefl as FF


def _columns(net: nn.Sequential, k: int, m: int) -> tuple[list[list[nn.Module]], nn.Linear]:
    """``m`` identical clients' fused levels of ``net`` cut into ``k`` blocks, adaptors initialised as averages."""
    blocks = [nn.Sequential(*[net[i] for i in range(a, b)]) for a, b in FF.BLOCKS[k]]
    probe, shapes = torch.zeros(1, 1, 28, 28), []
    for blk in blocks:
        probe = blk(probe)
        shapes.append(tuple(probe.shape[1:]))
    levels = [[copy.deepcopy(blocks[0]) for _ in range(m)]]
    for j in range(1, k):
        levels.append([nn.Sequential(FF._adaptor(shapes[j - 1], m, seed=j, init="avg"), copy.deepcopy(blocks[j]))
                       for _ in range(m)])
    return levels, copy.deepcopy(net[FF.CLASSIFIER])


def test_average_initialised_adaptors_make_identical_clients_one_column_times_m():
    """With every client's blocks equal, an adaptor starting as the average of the concatenated columns hands each
    block exactly the input it was trained on: the fused features are M times one LeNet's pre-logit features."""
    net = build_model("lenet", 10, (1, 28, 28), seed=3).eval()
    x = torch.randn(6, 1, 28, 28)
    with torch.no_grad():
        want = net[:FF.CLASSIFIER](x)
        for k in (2, 4):
            levels, head = _columns(net, k, m=3)
            fused = FF.FuseFLNet(levels, head).eval()
            assert torch.allclose(fused.features(x), 3 * want, atol=1e-4)
            assert fused(x).shape == (6, 10)
            site = fused.head_sites()[""]
            assert site.classifier is fused.classifier and torch.equal(site.features(x), fused.features(x))


def test_fusefl_steps_keep_the_fused_levels_frozen_and_count_the_uplink():
    """Two tiny clients, K = 2: after the step, level 1 is the clients' step-1 blocks unchanged, and each client's
    uplink is its block 1 + its adaptor and block 2 + its classifier."""
    gen = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(40, 1, 28, 28, generator=gen), "y": torch.randint(0, 10, (40,), generator=gen), "n": 40}
            for _ in range(2)]
    recipe = {"lr": 0.01, "weight-decay": 0.0, "epochs": 2, "batch-size": 16, "momentum": 0.9}
    step1 = [build_model("lenet", 10, (1, 28, 28), seed=s).eval() for s in (1, 2)]
    before = [n[0].weight.clone() for n in step1]
    res = FF.fusefl(data, seed=0, k_blocks=2, recipe=recipe, step1=step1)
    model = res["model"]
    assert all(torch.equal(model.levels[0][c][0].weight, before[c]) for c in range(2))
    assert not any(p.requires_grad for p in model.levels[0].parameters())
    block1 = 6 * 25 + 6 + 16 * 6 * 25 + 16
    adaptor2 = 2 * 16 * 16 + 16
    block2 = 256 * 120 + 120 + 120 * 84 + 84
    assert abs(res["uplink"] * FF.LENET_PARAMS - (block1 + adaptor2 + block2 + 850)) < 1e-6
    assert abs(res["size"] * FF.LENET_PARAMS - (2 * (block1 + adaptor2 + block2) + 850)) < 1e-6


def test_fens_fedavg_with_one_client_is_its_local_sgd():
    """R rounds of FedAvg with a single client are that client's local SGD run (server step = its model)."""
    gen = torch.Generator().manual_seed(1)
    z, y = torch.randn(64, 30, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    cfg = {"optimizer": "fedavg", "rounds": 1, "local-epochs": 3, "lr": 0.1, "batch-size": 16, "d": 2}
    agg, _ = FE.train_aggregator([(z, y)], cfg, seed=0, m=3)
    ref = FE.aggregator(3, 10, 2, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(500)
    for _ in range(3):
        perm = torch.randperm(64, generator=g)
        for s in range(0, 64, 16):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(z[perm[s:s + 16]]), y[perm[s:s + 16]]).backward()
            opt.step()
    for a, b in zip(agg.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_fens_fedadam_first_round_moves_each_weight_by_about_the_server_lr():
    """The public code's FedAdam without bias correction: after round 1 every coordinate with a non-zero delta moves
    by slr · (1-β1)Δ / (sqrt((1-β2)Δ²) + ε) — at most slr · (1-β1)/sqrt(1-β2) ≈ 1e-3."""
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(50, 30, generator=gen), torch.randint(0, 10, (50,), generator=gen)) for _ in range(2)]
    cfg = {**FE.PAPER, "rounds": 1}
    agg, _ = FE.train_aggregator(data, cfg, seed=0, m=3)
    start = FE.aggregator(3, 10, 2, seed=0)
    bound = cfg["slr"] * (1 - cfg["beta1"]) / (1 - cfg["beta2"]) ** 0.5
    for a, b in zip(agg.parameters(), start.parameters()):
        step = (a - b).detach().abs()
        assert float(step.max()) <= bound + 1e-7 and float(step.max()) > 0
