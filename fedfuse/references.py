"""One-shot references: what a one-shot paper reports next to a fused model, from the same client models.

In a one-shot run the server holds every client's trained model after round 1. Whether fusion paid off is read
against references computed from *those* models (no extra client training), on the server's test set:

| key | reference | cost |
|---|---|---|
| ``best-client`` | the best single client model (test accuracy; the partition named) | one test pass per client |
| ``mean-client`` | the mean of the clients' test accuracies | (the same passes) |
| ``ensemble`` | the sample-count-weighted mean softmax of the client models (KD's and FedDF's target) | none more |
| ``ensemble-uniform`` | the plain mean softmax (the round's ``ensemble-accuracy`` column) | none more |
| ``average`` | the sample-count-weighted average of the weights: one-shot FedAvg | one test pass |
| ``kd`` | ``fuse("kd", ...)``: the weighted ensemble distilled into client 0's model on the fusion set | training |
| ``feddf`` | ``fuse("feddf", ...)``: the weighted ensemble distilled into the weighted average (FedDF's server | training |
|  | step, Lin et al. 2020: with one round, FedDF's one-shot result) | |

``kd`` and ``feddf`` use ``fuse``'s default options (``kd``: 50 epochs of Adam over the fusion set; ``feddf``: at
most 50, early-stopped on a held-out fifth) and the fusion seed of round 1 (run seed + 1): some seconds for an MLP
on a few hundred fusion samples, more for larger models (each row's ``seconds`` says). ``distill=False`` leaves them
out. A reference that cannot be computed (e.g. no fusion set for ``kd``; clients of different widths for the
average) is a row with ``unavailable`` and the reason, never a silent gap; a distillation that ended predicting one
class for almost every fusion-set input (``fedfuse.fusion.output_checks``) keeps its row with a ``warning``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from fedfuse.fusion import FusionResult, fuse_result
from fedfuse.fusion.average import average_state_dicts
from fedfuse.training import metrics_from_logits, predict_logits

REFERENCE_KEYS = ("best-client", "mean-client", "ensemble", "ensemble-uniform", "average", "kd", "feddf")
# what each row is, as the runner's table and the plots name it
REFERENCE_LABELS = {"best-client": "best client", "mean-client": "mean client", "ensemble": "ensemble (weighted by samples)",
                    "ensemble-uniform": "ensemble (uniform)",
                    "average": "one-shot FedAvg (weighted average)", "kd": "KD (ensemble into client 0's model)",
                    "feddf": "FedDF (ensemble into the average)"}


def _normalised(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"one-shot references: the clients' weights (sample counts) must sum to > 0, got {weights}")
    return [float(w) / total for w in weights]


def client_rows(logits: Sequence[torch.Tensor], partition_ids: Sequence[int], weights: Sequence[float],
                test_y: torch.Tensor) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``({partition id: accuracy}, [best-client, mean-client, ensemble, ensemble-uniform rows])`` from the clients'
    test logits; ``ensemble`` is the ``weights``-weighted mean softmax, ``ensemble-uniform`` the plain mean."""
    accs = {str(p): metrics_from_logits(lg, test_y)["accuracy"] for p, lg in zip(partition_ids, logits)}
    best = max(accs, key=lambda p: accs[p])
    rows = [{"key": "best-client", "accuracy": accs[best], "partition-id": int(best)},
            {"key": "mean-client", "accuracy": sum(accs.values()) / len(accs)}]
    for key, w in (("ensemble", _normalised(weights)), ("ensemble-uniform", [1.0 / len(logits)] * len(logits))):
        probs = sum(wi * lg.softmax(-1) for wi, lg in zip(w, logits))
        rows.append({"key": key, "accuracy": metrics_from_logits(probs, test_y, probabilities=True)["accuracy"]})
    return accs, rows


def _model_row(key: str, make: Any, test_x: torch.Tensor, test_y: torch.Tensor, device: Any) -> dict[str, Any]:
    """The row of the model ``make()`` builds (a model, or a ``FusionResult``; its build time as ``seconds``), or
    ``unavailable`` with the reason when building it raises (the reason names the exception). A fusion that
    collapsed to one prediction (``FusionResult.info["collapse-warning"]``) keeps its row with that ``warning``."""
    t0 = time.perf_counter()
    try:
        built = make()
    except Exception as exc:  # noqa: BLE001 - reported in the row (and logged by the caller), never swallowed
        return {"key": key, "unavailable": f"{type(exc).__name__}: {exc}"}
    seconds = time.perf_counter() - t0
    model, info = (built.model, built.info) if isinstance(built, FusionResult) else (built, {})
    acc = metrics_from_logits(predict_logits(model, test_x, device=device), test_y)["accuracy"]
    row = {"key": key, "accuracy": acc, "seconds": seconds}
    if info.get("collapse-warning"):
        row["warning"] = info["collapse-warning"]
    return row


def one_shot_references(models: Sequence[nn.Module], weights: Sequence[float], partition_ids: Sequence[int], *,
                        test_x: torch.Tensor, test_y: torch.Tensor, fusion_inputs: torch.Tensor | None,
                        device: Any = "cpu", seed: int = 1, distill: bool = True,
                        logits: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
    """The references of the module docstring for one round's client ``models`` (same architecture for
    ``average``/``feddf``; ``weights`` = their sample counts, also the ensemble's and the distillations' weights).

    ``logits`` (the models' test logits, when the caller has them) saves the clients' test passes. Returns
    ``{"rows": [{"key", "accuracy", ["partition-id"], ["seconds"]} or {"key", "unavailable"}],
    "client-accuracy": {partition id: accuracy}, "seconds": total}``."""
    if not models:
        raise ValueError("one-shot references: no client models")
    t0 = time.perf_counter()
    if logits is None:
        logits = [predict_logits(m, test_x, device=device) for m in models]
    accs, rows = client_rows(logits, partition_ids, weights, test_y)
    w = _normalised(weights)

    def average() -> nn.Module:
        import copy

        model = copy.deepcopy(models[0]).cpu()
        model.load_state_dict(average_state_dicts([m.state_dict() for m in models], w))
        return model

    rows.append(_model_row("average", average, test_x, test_y, device))
    for method in ("kd", "feddf"):
        if not distill:
            continue
        if fusion_inputs is None or len(fusion_inputs) == 0:
            rows.append({"key": method, "unavailable": "the server has no fusion set (fusion inputs) to distil on"})
            continue
        rows.append(_model_row(method, lambda m=method: fuse_result(m, list(models), fusion_inputs=fusion_inputs,
                                                                       weights=w, device=device, seed=seed),
                               test_x, test_y, device))
    return {"rows": rows, "client-accuracy": accs, "seconds": time.perf_counter() - t0}


def gap_recovered(fused: float, best_client: float, ensemble: float) -> float | None:
    """``(fused − best client) / (ensemble − best client)``: the share of the gap between the best client and the
    ensemble that the fused model closes (1 = as good as the ensemble, < 0 = below the best client); ``None`` when
    the ensemble is not above the best client (no gap to close)."""
    gap = ensemble - best_client
    return (fused - best_client) / gap if gap > 1e-12 else None
