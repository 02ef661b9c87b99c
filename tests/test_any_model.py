"""Fusing the models users bring (issue 57): the generic structure reader on models fedfuse did not write.

For every model of the zoo and every alignment method: ``fuse(method, [m, m])`` computes ``m``'s function, a copy
``P(m)`` permuted by a random permutation of the reader's own groups computes ``m``'s function, and the matching
methods undo ``P``: ``fuse(method, [m, P(m)])`` computes ``m``'s function. BatchNorm statistics are taken from the
fusion set first (re-estimated on the set ``m``'s statistics came from, fusion gives them back). Small inputs
(3 × 32 × 32) keep it fast; the large torchvision / timm models are slow tests (CI runs them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion import fuse
from fedfuse.fusion.permute import build_spec, reset_bn_stats
from fedfuse.fusion.permute.maps import permute_model, random_perms
from fedfuse.models import adapter_for, levels, set_example_input
from fedfuse.models.adapters import UnsupportedModelError

# the full-size zoo takes tens of minutes on 2 cores: its own switch (the zoo table benchmark writes the table)
ZOO = pytest.mark.skipif(not os.environ.get("FEDFUSE_ZOO_TESTS"), reason="full-size zoo: FEDFUSE_ZOO_TESTS=1")


class Net(nn.Module):
    """Flower's quickstart-pytorch model, unchanged."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class ListMLP(nn.Module):
    """Layers in an ``nn.ModuleList``, functional activations, ``torch.flatten`` in ``forward`` (on 4 × 4-pooled
    pixels: the chain variant's closed form on 3,072 raw inputs costs seconds the suite does not need)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3 * 8 * 8, 48), nn.Linear(48, 32), nn.Linear(32, 10)])

    def forward(self, x):
        x = torch.flatten(F.avg_pool2d(x, 4), 1)
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


class SkipCNN(nn.Module):
    """A hand-written skip connection (``x + block(x)``) with BatchNorm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.down = nn.Conv2d(16, 24, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(24)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(x + self.block(x))
        x = F.relu(self.bn2(self.down(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Dense(nn.Module):
    """A channel concatenation (DenseNet's pattern)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 6, 3, padding=1)
        self.c = nn.Conv2d(14, 12, 1)
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        a = F.relu(self.a(x))
        h = torch.cat([a, F.relu(self.b(a))], 1)
        return self.fc(F.relu(self.c(h)).mean((2, 3)))


def _tv(name, **kw):
    import torchvision
    return lambda: getattr(torchvision.models, name)(num_classes=10, **kw)


def _timm(name, **kw):
    import timm
    return lambda: timm.create_model(name, num_classes=10, **kw)


def _resnext_small():
    """torchvision's ResNeXt (grouped 3 × 3 convolutions in every Bottleneck), one block a stage, 4 groups of 4."""
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4, num_classes=10)


def _mixer_small():
    """timm's MLP-Mixer, two blocks (its PatchEmbed asserts the input size between the input and its projection)."""
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)


FAST = {"quickstart-net": Net, "modulelist-mlp": ListMLP, "skip-cnn": SkipCNN, "concat-cnn": Dense,
        "tv:mobilenet_v2-0.25": _tv("mobilenet_v2", width_mult=0.25), "timm:mixer-small": _mixer_small,
        "timm:convnext_atto-small": _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 24, 32, 48)), "timm:mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
        "timm:vit_tiny": _timm("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2)}
LARGE = {"tv:vgg11_bn": _tv("vgg11_bn"), "tv:resnet18": _tv("resnet18"), "tv:resnet50": _tv("resnet50"),
         "tv:mobilenet_v2": _tv("mobilenet_v2"), "tv:efficientnet_b0": _tv("efficientnet_b0"),
         "tv:densenet121": _tv("densenet121"), "tv:convnext_tiny": _tv("convnext_tiny"),
         "tv:resnext50_32x4d": _tv("resnext50_32x4d"),
         "timm:resnet18": _timm("resnet18"), "timm:efficientnet_b0": _timm("efficientnet_b0"),
         "timm:vit_tiny_patch16_224": _timm("vit_tiny_patch16_224", img_size=32, patch_size=4)}
MATCHING = ("rebasin", "ot", "kf-linear", "hf-linear")
OTHERS = ("transfusion", "kf-gradient", "hf-gradient", "fs-merge")
# budgets of the trained methods: the checks are about exactness (the fixed point), not about training
OPTIONS = {"kf-gradient": dict(epochs=1, head_epochs=1), "hf-gradient": dict(epochs=1, head_epochs=1),
           "fs-merge": dict(steps=4)}
X = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _model(factory) -> nn.Module:
    torch.manual_seed(0)
    m = factory().eval()
    with torch.no_grad():   # norms away from their identity initialisation, statistics from the fusion set
        g = torch.Generator().manual_seed(1)
        for mod in m.modules():
            if isinstance(mod, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)) and mod.weight is not None:
                mod.weight.add_(0.2 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.add_(0.2 * torch.randn(mod.bias.shape, generator=g))
    reset_bn_stats(m, X)
    set_example_input(m, X)
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _f64(model: nn.Module) -> torch.Tensor:
    """The model's outputs on ``X``, computed in float64 (so that float32 round-off of a deep net's summation
    order is not mistaken for a wrong permutation)."""
    import copy
    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(X.double())


def _check(factory, methods, tol=1e-5):
    """The checks on a float64 copy of the model, fused on float64 inputs: each method computes in the models' dtype,
    so what is measured is the method's exactness, not float32 round-off of tens of refitted layers."""
    m = _model(factory).double()
    reset_bn_stats(m, X.double())   # the statistics in float64 too: those the methods that re-estimate them get
    y = _f64(m)
    spec = build_spec(m)
    p = permute_model(m, random_perms(spec, seed=3))
    assert _rel(_f64(p), y) <= tol, "P(m) must compute m's function"
    if any(g.size > 1 for g in spec.groups.values()):
        assert any(not torch.equal(a, b) for a, b in zip(m.state_dict().values(), p.state_dict().values()))
    errors = {}
    for method in methods:
        same = fuse(method, [m, m], fusion_inputs=X.double(), **OPTIONS.get(method, {}))
        errors[(method, "m,m")] = _rel(_f64(same), y)
        if method in MATCHING:
            undone = fuse(method, [m, p], fusion_inputs=X.double())
            errors[(method, "m,P(m)")] = _rel(_f64(undone), y)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"fusion does not give m back: {bad}"


@pytest.mark.parametrize("name", sorted(FAST))
def test_zoo_models_fuse_exactly(name):
    _check(FAST[name], MATCHING + OTHERS)


@ZOO
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGE))
def test_large_zoo_models_fuse_exactly(name):
    _check(LARGE[name], ("rebasin", "ot", "kf-linear"))


def test_the_reader_takes_user_models_and_finds_their_structure():
    net = _model(Net)
    assert adapter_for(net).family == "graph"
    spec = build_spec(net)
    assert sorted(spec.groups) == ["conv1", "conv2", "fc1", "fc2"]
    fc1 = spec.entries["fc1.weight"]   # conv2's 16 channels each own a 5 × 5 block of fc1's 400 inputs
    assert fc1.view == (120, 16, 25) and {(a.group, a.axis, a.role) for a in fc1.axes} == {("fc1", 0, "out"),
                                                                                           ("conv2", 1, "in")}
    assert spec.classifier == ("fc3.weight", "fc3.bias")
    lv = levels(net)
    assert [l.name for l in lv] == ["conv1", "conv2", "fc1", "fc2", "fc3"] and all(l.affine for l in lv)
    h = X
    for level in lv:
        h = level.run(h)
    assert torch.allclose(h, net(X), atol=1e-6)
    skip = build_spec(_model(SkipCNN))   # the stream: stem, its BN and the block's last conv + BN in one group
    stream = next(g for g in skip.groups if any(e.name == "block.3.weight" and ax.role == "out"
                                                for e, ax in skip.entries_of(g)))
    outs = {e.name for e, ax in skip.entries_of(stream) if ax.role == "out"}
    assert {"stem.weight", "bn.weight", "block.3.weight", "block.4.weight"} <= outs


def test_graph_kf_linear_reports_what_it_refitted():
    from fedfuse.fusion import fuse_result
    m = _model(SkipCNN)
    res = fuse_result("kf-linear", [m, m], fusion_inputs=X)
    report = res.info["graph"]
    assert "head" in report["refit"] and "stem" in report["refit"] and "bn" in report["folded"]


def test_untraceable_models_get_one_clear_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            if x.sum() > 0:   # data-dependent control flow: fx cannot trace it
                x = -x
            return self.fc(x)

    m = Branchy()
    with pytest.raises(UnsupportedModelError, match="torch.fx cannot trace Branchy.*control flow"):
        adapter_for(m).perm_spec(m)
    with pytest.raises(ValueError, match="torch.fx cannot trace Branchy.*control flow"):
        build_spec(m)
    with pytest.raises(ValueError, match="cannot trace Branchy"):
        fuse("rebasin", [m, Branchy()], fusion_inputs=torch.randn(8, 4))
    assert fuse("average", [m, Branchy()]) is not None   # methods that read no structure still take it


def test_grouped_convolutions_are_refused_or_frozen_never_a_shape_error():
    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 3, padding=1)
            self.g = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(F.relu(self.g(F.relu(self.a(x)))).mean((2, 3)))

    m = _model(Grouped)
    spec = build_spec(m)
    assert any("grouped convolution 'g'" in f for f in spec.frozen)   # its channels stay where they are
    _check(Grouped, ("rebasin", "ot", "kf-linear"))


def test_client_importance_scores_on_the_readers_levels():
    from fedfuse.importance import neuron_importance
    net = _model(Net)
    y = torch.randint(0, 10, (len(X),), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="DeepLIFT cannot score Net.*'pool'.*conductance"):
        scores = neuron_importance(net, X, y, method="deeplift")   # Net applies its one MaxPool2d twice
    assert {k: v.shape[0] for k, v in scores.items()} == {"conv1": 6, "conv2": 16, "fc1": 120, "fc2": 84, "fc3": 10}
    skip = _model(SkipCNN)   # a block level read at the input of the module that takes it
    scores = neuron_importance(skip, X, y, method="deeplift")
    assert all(bool((v > 0).all()) for v in scores.values()) and len(scores) == len(levels(skip))
    fused = fuse("kf-linear", [skip, _model(SkipCNN)], fusion_inputs=X, scores=[scores, scores])
    assert torch.isfinite(fused(X)).all()


def test_a_zoo_model_federates_with_an_alignment_strategy(tmp_path):
    """fedfuse's own app with a model it did not write (timm's MobileNetV3: depthwise convs, SE gates,
    hard-swish) fused by OT each round, on the in-process engine."""
    _federate_two_clients(tmp_path, model="timm:mobilenetv3_small_050", strategy="ot", **{"head-round": True})


def _federate_two_clients(tmp_path, **cfg):
    """One round of fedfuse's app with ``cfg`` (a zoo model) on digits, 2 clients, the in-process engine: every reply
    fused (no fallback), the model above chance."""
    from fedfuse.flower.runner.inprocess import run_app_inprocess
    cfg = {"dataset": "digits", "num-clients": 2, "partitioning": "iid", "num-server-rounds": 1, "local-epochs": 1,
           "lr": 0.05, "fusion-set-size": 64, "min-train-nodes": 2, "output-dir": str(tmp_path), "run-name": "zoo",
           **cfg}
    outcome = run_app_inprocess(cfg, num_supernodes=2, echo=False)
    assert outcome.ok, outcome.details
    res = json.loads((tmp_path / "zoo" / "results.json").read_text())
    hist = res["strategy-history"]
    assert hist and all(h["valid"] == 2 and h["fallback"] is None for h in hist), hist
    assert res["rounds"][-1]["test-accuracy"] > 0.1


def test_groups_that_would_change_the_function_are_left_in_place():
    """A hand-written attention (a fused q/k/v Linear reshaped into heads): the dependency graph's channel group
    across q, k and v is not a symmetry; the reader checks every group and keeps such units where they are."""
    class Attn(nn.Module):
        def __init__(self, d=16, h=2):
            super().__init__()
            self.h = h
            self.embed = nn.Linear(12, d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.head = nn.Linear(d, 10)

        def forward(self, x):
            t = self.embed(x.reshape(x.shape[0], 4, 12))     # 4 tokens
            b, n, d = t.shape
            q, k, v = self.qkv(t).reshape(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            a = (q @ k.transpose(-2, -1) / (d // self.h) ** 0.5).softmax(-1)
            t = t + self.proj((a @ v).transpose(1, 2).reshape(b, n, d))
            return self.head(t.mean(1))

    x = torch.randn(8, 48)
    m = Attn().eval()
    set_example_input(m, x)
    spec = build_spec(m)
    p = permute_model(m, random_perms(spec, seed=1))
    assert torch.allclose(p(x), m(x), atol=1e-5)
    undone = fuse("rebasin", [m, p], fusion_inputs=x)
    assert torch.allclose(undone(x), m(x), atol=1e-5)


def _partition(spec, state):
    """The spec's groups as a set of frozensets of (tensor, raw axis, role): names and views aside."""
    import math

    def raw(e, ax):
        if e.view is None:
            return ax.axis
        before = math.prod(e.view[:ax.axis])
        shape, acc = state[e.name].shape, 1
        for i, n in enumerate(shape):
            if acc == before:
                return i
            acc *= n
        raise AssertionError(e.name)

    out = set()
    for g in spec.groups:
        out.add(frozenset((e.name, raw(e, ax), ax.role) for e, ax in spec.entries_of(g)))
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "lenet", "resnet", "tv:resnet18", "tv:resnet50"])
def test_generic_groups_equal_the_hand_written_ones(name):
    """The hand-written adapters' groups are exactly what the generic reader reads off the same models (the ViT
    adapter stays hand-written: timm's fused q/k/v has a head structure no channel group describes)."""
    from fedfuse.models import build_model
    from fedfuse.models.adapters import GraphAdapter
    if name.startswith("tv:"):
        import torchvision
        m, shape = getattr(torchvision.models, name[3:])(num_classes=10).eval(), (3, 32, 32)
    else:
        shape = (1, 28, 28)
        m = build_model(name, input_shape=shape, seed=0).eval()
    set_example_input(m, torch.zeros(2, *shape))
    hand, generic = adapter_for(m), GraphAdapter()
    assert hand.family != "graph"
    state = m.state_dict()
    assert _partition(generic.perm_spec(m), state) == _partition(hand.perm_spec(m), state)
    assert generic.perm_spec(m).classifier == hand.perm_spec(m).classifier
    if hand.family == "sequential":   # chains: the same levels too
        assert [(lv.name, lv.width, lv.kind) for lv in generic.levels(m)] == \
            [(lv.name, lv.width, lv.kind) for lv in hand.levels(m)]


def test_a_user_model_whose_input_the_first_layer_does_not_tell():
    """The quickstart Net rebuilt for 1 × 28 × 28 (fc1 takes 16·4·4): the reader cannot guess the input, the
    client-side calls record it from the data they get, and a clear error names what to do otherwise."""
    from fedfuse.importance import neuron_importance
    from fedfuse.progressive import head_statistics

    class Net28(Net):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 6, 5)
            self.fc1 = nn.Linear(16 * 4 * 4, 120)

        def forward(self, x):
            x = self.pool(F.relu(self.conv2(self.pool(F.relu(self.conv1(x))))))
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))))

    with pytest.raises(ValueError, match="set_example_input"):
        levels(Net28())
    x, y = torch.randn(12, 1, 28, 28), torch.randint(0, 10, (12,))
    scores = neuron_importance(Net28(), x, y, method="uniform")
    assert scores["fc1"].shape == (120,)
    assert head_statistics(Net28(), x, y, 10).num_examples == 12


def test_capacity_tiers_with_a_model_fedfuse_did_not_write(tmp_path):
    """A zoo model federates with capacity tiers: the narrow clients' models are copies cut along the reader's own
    groups (Torch-Pruning), nested top-left slices of the global model, aggregated back (HeteroFL's rule, ``ot``).
    With the head round: MobileNetV2's clients do not learn digits in one local epoch (their ensemble is at chance,
    10.0 %), so the aggregate's own accuracy sits at chance and says nothing (8.6 % on one CPU, above 10 % on
    another); the classifier solved on the aggregate's features is what shows that the tiers fused back into a
    working feature extractor (35.7 %)."""
    _federate_two_clients(tmp_path, model="torchvision:mobilenet_v2", strategy="ot",
                          **{"client-tiers": "1,0.5", "head-round": True})


def test_a_resnext_is_read_by_the_graph_reader_with_its_grouped_convolutions_in_place():
    """torchvision's ResNeXt is a torchvision ``ResNet``, but its grouped convolutions constrain the channel
    permutations: the family adapter (which permutes every Bottleneck's inner channels freely) leaves it to the graph
    reader, which leaves the groups a grouped convolution touches in place and names them, and a permuted copy is
    matched back exactly."""
    pytest.importorskip("torchvision")
    m = _model(_resnext_small)
    assert adapter_for(m).family == "graph"
    spec = build_spec(m)
    assert any("grouped convolution" in f and "(groups=4)" in f for f in spec.frozen)
    assert spec.groups   # the stream and stem groups are still aligned
    _check(_resnext_small, ("rebasin",))   # every method: the full-size zoo's ResNeXt-50 (FEDFUSE_ZOO_TESTS=1)


@pytest.mark.timeout(120)
def test_a_model_whose_dependency_search_runs_away_is_refused_not_hung():
    """torchvision's Swin: Torch-Pruning's group search, through the window-attention reshapes, multiplies the unit
    indices without end (it ran for hours before the bound). The graph reader stops it and refuses the model with a
    reason in well under a second; the methods that need no alignment still fuse it."""
    tv = pytest.importorskip("torchvision.models")
    from fedfuse.fusion import IncompatibleModelsError

    m = _model(lambda: tv.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                          window_size=[2, 2], num_classes=10))
    for method in ("ot", "kf-linear"):
        with pytest.raises(IncompatibleModelsError, match="runs away on SwinTransformer"):
            fuse(method, [m, m], fusion_inputs=X)
    assert fuse("average", [m, m])(X).shape == (24, 10)


def test_narrow_copies_refuse_a_forward_that_hard_codes_a_width():
    """The quickstart Net's ``x.view(-1, 16 * 5 * 5)`` cannot run narrower: one clear refusal, not a wrong batch."""
    m = Net()
    set_example_input(m, X)
    with pytest.raises(UnsupportedModelError, match="hard-codes a width"):
        adapter_for(m).at_width_mult(m, 0.5)
    narrow = adapter_for(m).at_width_mult(m, 1.0)
    assert [v.shape for v in narrow.state_dict().values()] == [v.shape for v in m.state_dict().values()]


class _TokenMixer(nn.Module):
    """An MLP-Mixer block in miniature: a Linear across tokens (after a transpose) and one across channels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 24, 8, stride=8)                 # 16 tokens of 24 channels at 32 x 32
        self.tok1, self.tok2 = nn.Linear(16, 20), nn.Linear(20, 16)
        self.ch1, self.ch2 = nn.Linear(24, 32), nn.Linear(32, 24)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        h = self.embed(x).flatten(2).transpose(1, 2)               # [N, tokens, channels]
        h = h + self.tok2(F.gelu(self.tok1(h.transpose(1, 2)))).transpose(1, 2)
        h = h + self.ch2(F.gelu(self.ch1(h)))
        return self.head(h.mean(1))


def test_a_misread_group_is_left_in_place_and_the_rest_aligned():
    """Torch-Pruning maps the token-mixing Linear's token axis as if it were channels: that group is frozen (named
    in ``spec.frozen``), the hidden groups are still permuted, and every method is exact on the model."""
    m = _model(_TokenMixer)
    spec = build_spec(m)
    assert any("positions" in f for f in spec.frozen)
    assert len(spec.groups) >= 2
    _check(_TokenMixer, MATCHING + OTHERS)
