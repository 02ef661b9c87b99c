"""The broadcast guard (``fedfuse.flower.round.divergence``): a global model with finite weights but non-finite
outputs (a BatchNorm running variance below zero) is never broadcast; the round keeps the previous model, records
why and which reply broke it."""

import copy

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn

from fedfuse.flower.round.divergence import guard_broadcast, non_finite_outputs
from fedfuse.flower.round.replies import ClientUpdate


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()


class _Strategy:
    """The parts of a fedfuse strategy the guard uses; ``aggregate_train`` returns the state it is given."""

    def __init__(self, out_state, updates):
        self.out_state, self.last_updates = out_state, updates
        self.history, self.fallbacks, self.round_offset = [], 0, 0

    def build_model(self, state):
        m = _model()
        m.load_state_dict(state)
        return m.eval()

    def on_fallback(self):
        self.fallbacks += 1

    def aggregate_train(self, server_round, replies):
        self.history.append({"round": server_round, "fallback": None})
        return ArrayRecord(copy.deepcopy(self.out_state)), MetricRecord({"fell-back": 0})


def test_a_global_model_with_nan_outputs_is_not_broadcast_and_its_reply_is_named():
    good = _model().state_dict()
    bad = copy.deepcopy(good)
    bad["1.running_var"][:] = -1.0   # finite weights, NaN outputs (sqrt of a negative variance)
    assert all(torch.isfinite(v.float()).all() for v in bad.values())
    probe = torch.randn(16, 4)
    assert non_finite_outputs(_Strategy(None, []).build_model(bad), probe) is not None
    updates = [ClientUpdate(1, 0, good, None, 10, {"tier": 1.0}), ClientUpdate(2, 1, bad, None, 10, {"tier": 0.5})]
    s = _Strategy(bad, updates)
    guard_broadcast(s, probe)
    arrays, metrics = s.aggregate_train(3, [])
    assert arrays is None and metrics["fell-back"] == 1 and s.fallbacks == 1   # Flower keeps the previous model
    rec = s.history[-1]
    assert rec["fallback"].startswith("previous: the new global model has non-finite outputs on 16 of 16")
    assert [(c["node-id"], c["tier"]) for c in rec["broadcast-guard"]["replies"]] == [(2, 0.5)]


def test_a_finite_global_model_passes_untouched():
    good = _model().state_dict()
    s = _Strategy(good, [])
    guard_broadcast(s, torch.randn(8, 4))
    arrays, metrics = s.aggregate_train(1, [])
    assert arrays is not None and s.fallbacks == 0 and s.history[-1]["fallback"] is None
    assert torch.equal(arrays.to_torch_state_dict()["0.weight"], good["0.weight"])
