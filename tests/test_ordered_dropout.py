"""FjORD's ordered dropout in tiered local training (issue 13): the drawn sub-model is exactly the narrower tier's
model, its gradients stay inside its slice, the strategy sends every node its narrower tiers, the config key."""

from unittest.mock import Mock

import pytest
import torch
from flwr.app import ConfigRecord

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower.tiers.client_tiers import OD_KEY, tier_forward, tier_model
from fedfuse.hetero import slice_state, submodel
from fedfuse.hetero.ordered_dropout import OrderedDropout
from fedfuse.hetero.tiers import resolve_ordered_dropout
from fedfuse.models import adapter_for, build_model

FAMILIES = [("mlp", (40,)), ("cnn", (1, 8, 8)), ("vit", (1, 8, 8))]


def _at(g, r, shape, seed):
    return adapter_for(g).at_width_mult(g, r, seed=seed, input_shape=shape)


@pytest.mark.parametrize("family,shape", FAMILIES)
def test_each_draw_is_the_nested_tier_model_and_trains_only_its_slice(family, shape):
    g = build_model(family, num_classes=10, input_shape=shape, width=64, seed=0)
    half = _at(g, 0.5, shape, seed=1)                     # the client: tier 0.5
    ref = _at(g, 0.25, shape, seed=2)                     # what the server would send a 0.25 client
    ref.load_state_dict(slice_state(half.state_dict(), submodel(half, ref)))
    od = OrderedDropout(half, [_at(g, 0.25, shape, seed=3)], seed=0)
    half.eval()
    ref.eval()
    x = torch.randn(6, *shape)
    seen = set()
    for _ in range(12):
        before = list(od.draws)
        y = od(x)
        k = next(i for i, (a, b) in enumerate(zip(before, od.draws)) if a != b)
        seen.add(k)
        with torch.no_grad():
            assert torch.allclose(y, half(x) if k == 0 else ref(x), atol=1e-5)
    assert seen == {0, 1}                                 # both widths are drawn
    # a narrow draw's gradient lands on the entries its sub-model holds, nowhere else
    half.zero_grad()
    while True:
        before = list(od.draws)
        y = od(x)
        if od.draws[1] != before[1]:
            break
    y.square().sum().backward()
    pos = submodel(half, ref).positions
    for name, p in half.named_parameters():
        inside = torch.zeros(p.numel(), dtype=torch.bool)
        inside[pos[name].reshape(-1)] = True
        grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
        assert not grad[~inside].any(), name
        assert grad[inside].abs().sum() > 0, name


def test_client_forward_from_the_train_config():
    g = build_model("mlp", 10, (40,), width=32, depth=2)
    cfg = {"tier-width-mult": 1.0, OD_KEY: [0.5, 0.25]}
    model = tier_model(g, cfg, seed=0, input_shape=(40,))
    fwd = tier_forward(g, model, cfg, seed=0, input_shape=(40,))
    assert [adapter_for(m).config(m, (40,)) != adapter_for(g).config(g, (40,)) for m, _ in fwd.subs] == [True, True]
    assert tier_forward(g, model, {"tier-width-mult": 0.25}, seed=0, input_shape=(40,)) is None
    with pytest.raises(ValueError, match=OD_KEY):
        tier_forward(g, model, {"tier-width-mult": 0.5, OD_KEY: [0.5]}, seed=0, input_shape=(40,))


def test_strategy_sends_each_node_its_narrower_tiers(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from fedfuse.flower.round.protocol import state_to_record
    from fedfuse.flower.tiers.tiered import build_tier_strategy

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    expected = {"all": {1: [0.5, 0.25], 2: [0.25], 3: None}, "narrow": {1: None, 2: [0.25], 3: None},
                "off": {1: None, 2: None, 3: None}}
    for mode, want in expected.items():
        s = build_tier_strategy("average", tiers=(1.0, 0.5, 0.25), input_shape=(40,), seed=0, ordered_dropout=mode,
                                model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2))
        s.tier_layout.node_tier = {1: 1.0, 2: 0.5, 3: 0.25}
        grid = Mock()
        grid.get_node_ids.return_value = [1, 2, 3]
        arrays = state_to_record(build_model("mlp", 10, (40,), width=16, depth=2).state_dict())
        msgs = list(s.configure_train(1, arrays, ConfigRecord({}), grid))
        sent = {int(m.metadata.dst_node_id): m.content.config_records[s.configrecord_key].get(OD_KEY) for m in msgs}
        assert sent == want, mode
    # the Python API's default is the run config's: auto = all for average (off in a one-shot round), off for HeteroFL
    for name, cfg, want in (("average", {}, [0.5, 0.25]), ("average", {"mode": "one-shot"}, None),
                            ("heterofl", {}, None)):
        s = build_tier_strategy(name, tiers=(1.0, 0.5, 0.25), input_shape=(40,), seed=0,
                                model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2))
        s.tier_layout.node_tier = {1: 1.0, 2: 0.5, 3: 0.25}
        msgs = list(s.configure_train(1, arrays, ConfigRecord(cfg), grid))
        got = {int(m.metadata.dst_node_id): m.content.config_records[s.configrecord_key].get(OD_KEY) for m in msgs}
        assert got[1] == want, (name, cfg)


def test_ordered_dropout_config():
    assert {resolve_ordered_dropout(s, "auto") for s in ("heterofl", "fedrolex", "feddf")} == {"off"}
    assert resolve_ordered_dropout("average", "auto") == resolve_ordered_dropout("kf-linear", "auto") == "all"
    assert resolve_ordered_dropout("kf-linear", "auto", "one-shot") == "off"           # measured: OD hurts one-shot
    assert resolve_ordered_dropout("kf-linear", "all", "one-shot") == "all"
    assert resolve_ordered_dropout("heterofl", "all") == "all" and resolve_ordered_dropout("average", "off") == "off"
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "heterofl", "ordered-dropout": "all"})
    with pytest.raises(ConfigError, match="ordered-dropout"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "average", "ordered-dropout": "yes"})
    with pytest.raises(ConfigError, match="ordered-dropout"):
        parse_run_config({"strategy": "average", "ordered-dropout": "all"})   # no tiers: nothing narrower to train
    assert parse_run_config({"strategy": "average"}).ordered_dropout == "auto"   # default, no tiers: silent no-op




def test_draw_weights_the_widths_as_asked():
    from fedfuse.hetero.ordered_dropout import draw_weights

    g = build_model("mlp", 10, (40,), width=32, depth=2)
    subs = [_at(g, 0.5, (40,), seed=1), _at(g, 0.25, (40,), seed=2)]
    n = 4000
    draws = {name: OrderedDropout(g, subs, seed=0, weights=draw_weights(d, 1.0, [0.5, 0.25]))
             for name, d in (("uniform", "uniform"), ("own", 0.8), ("width", "width"))}
    freq = {name: [c / n for c in torch.bincount(torch.tensor([od.draw() for _ in range(n)]), minlength=3).tolist()]
            for name, od in draws.items()}
    assert all(abs(f - 1 / 3) < 0.03 for f in freq["uniform"])                     # FjORD: every width alike
    assert [round(f, 1) for f in freq["own"]] == [0.8, 0.1, 0.1]                    # own 0.8, the rest evenly
    assert all(abs(f - w / 1.75) < 0.03 for f, w in zip(freq["width"], (1, 0.5, 0.25)))   # in proportion to width
    assert draw_weights("width", 1.0, [0.125]) == [1.0, 0.125]
    for bad in (0, 1, 1.5, "most", True):
        with pytest.raises(ValueError, match="draw"):
            draw_weights(bad, 1.0, [0.5])
    with pytest.raises(ValueError, match="weights"):
        OrderedDropout(g, subs, weights=[1.0, 0.5])


def test_ordered_dropout_draw_from_run_config_to_the_client():
    from fedfuse.flower.tiers.client_tiers import OD_DRAW_KEY

    for value in ("0.75", "width"):
        cfg = parse_run_config({"client-tiers": "1,0.5", "strategy": "average", "ordered-dropout-draw": value})
        assert cfg.ordered_dropout_draw == value
    for bad, match in (({"client-tiers": "1,0.5", "strategy": "average", "ordered-dropout-draw": "most"}, "probability"),
                       ({"client-tiers": "1,0.5", "strategy": "average", "ordered-dropout-draw": "1"}, "probability"),
                       ({"ordered-dropout-draw": "0.5"}, "needs capacity tiers"),
                       ({"client-tiers": "1,0.5", "strategy": "average", "ordered-dropout": "off",
                         "ordered-dropout-draw": "width"}, "needs capacity tiers")):
        with pytest.raises(ConfigError, match="ordered-dropout-draw"):
            parse_run_config(bad)
    g = build_model("mlp", 10, (40,), width=32, depth=2)
    half = tier_model(g, {"tier-width-mult": 0.5}, seed=0, input_shape=(40,))
    fwd = tier_forward(g, half, {"tier-width-mult": 0.5, OD_KEY: [0.25], OD_DRAW_KEY: "width"}, seed=0,
                       input_shape=(40,))
    assert fwd.cumulative.tolist() == pytest.approx([2 / 3, 1.0])      # a 0.5 client: its width 0.5 vs 0.25
    with pytest.raises(ValueError, match=OD_DRAW_KEY):
        tier_forward(g, g, {"tier-width-mult": 1.0, OD_KEY: [0.5], OD_DRAW_KEY: 2.0}, seed=0, input_shape=(40,))


def test_strategy_sends_the_draw_with_the_narrower_tiers(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from fedfuse.flower.tiers.client_tiers import OD_DRAW_KEY
    from fedfuse.flower.round.protocol import state_to_record
    from fedfuse.flower.tiers.tiered import build_tier_strategy

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    with pytest.raises(ValueError, match="ordered_dropout_draw"):
        build_tier_strategy("average", tiers=(1.0, 0.5), input_shape=(40,), seed=0, ordered_dropout_draw=1.0,
                            model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2))
    s = build_tier_strategy("average", tiers=(1.0, 0.5), input_shape=(40,), seed=0, ordered_dropout_draw="width",
                            model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2))
    s.tier_layout.node_tier = {1: 1.0, 2: 0.5}
    grid = Mock()
    grid.get_node_ids.return_value = [1, 2]
    arrays = state_to_record(build_model("mlp", 10, (40,), width=16, depth=2).state_dict())
    msgs = list(s.configure_train(1, arrays, ConfigRecord({}), grid))
    sent = {int(m.metadata.dst_node_id): m.content.config_records[s.configrecord_key].get(OD_DRAW_KEY) for m in msgs}
    assert sent == {1: "width", 2: None}     # the narrowest tier has no narrower width: nothing to draw


def test_draw_auto_is_the_measured_best_per_strategy_and_family():
    from fedfuse.flower.tiers.tiered import build_tier_strategy
    from fedfuse.hetero.tiers import resolve_ordered_dropout_draw

    assert resolve_ordered_dropout_draw("average", "auto", "mlp") == resolve_ordered_dropout_draw("kf-linear", "auto",
                                                                                                  "cnn") == "width"
    assert resolve_ordered_dropout_draw("average", "auto", "vit") == "uniform"     # measured: width cost ViT tiers
    assert {resolve_ordered_dropout_draw(s, "auto", "mlp") for s in ("heterofl", "fedrolex", "feddf")} == {"uniform"}
    assert resolve_ordered_dropout_draw("average", 0.75, "mlp") == 0.75
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average"}).ordered_dropout_draw == "auto"
    s = build_tier_strategy("average", tiers=(1.0, 0.5), input_shape=(40,), seed=0,
                            model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2))
    assert s.ordered_dropout_draw == "width"


def test_sandwich_rule_trains_the_own_width_every_batch_plus_one_narrower():
    """``ordered-dropout-draw='sandwich'``: the batch loss is the own width's cross-entropy plus one narrower width's
    (drawn uniformly), so the full model's entries get every batch's gradient and a narrower draw adds to its slice."""
    from fedfuse.flower.tiers.client_tiers import OD_DRAW_KEY

    torch.manual_seed(0)
    g = build_model("mlp", 10, (40,), width=32, depth=2, seed=0)
    fwd = tier_forward(g, g, {"tier-width-mult": 1.0, OD_KEY: [0.5, 0.25], OD_DRAW_KEY: "sandwich"}, seed=0,
                       input_shape=(40,))
    assert fwd.sandwich and fwd.cumulative is None
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    for _ in range(40):
        before = list(fwd.draws)
        loss = fwd.loss(x, y)
        k = next(i for i in (1, 2) if fwd.draws[i] != before[i])
        sub = fwd.subs[k - 1][0]
        sub.load_state_dict(slice_state(g.state_dict(), submodel(g, sub)))
        with torch.no_grad():
            want = (torch.nn.functional.cross_entropy(g(x), y) + torch.nn.functional.cross_entropy(sub(x), y))
        assert torch.allclose(loss, want, atol=1e-5)
    assert fwd.draws[0] == 40 and fwd.draws[1] > 5 and fwd.draws[2] > 5   # the own width every batch
    g.zero_grad()
    fwd.loss(x, y).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in g.parameters())
    with pytest.raises(ValueError, match="sandwich"):
        OrderedDropout(g, [], sandwich=True)
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average",
                             "ordered-dropout-draw": "sandwich"}).ordered_dropout_draw == "sandwich"
