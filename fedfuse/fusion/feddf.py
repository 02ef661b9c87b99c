"""FedDF: weighted averaging, then ensemble distillation into the average on the server's fusion set.

Lin, Kong, Stich & Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated Learning"
(NeurIPS 2020, arXiv 2006.07242). The round's client models are
averaged (sample-count weights), and the average (the student) learns the clients' weighted mean softmax
on the unlabeled fusion set with Adam (lr 1e-3), early-stopped on a held-out part of the fusion set by the
KL to the ensemble (the paper stops on the ensemble agreement). The step itself is
``fedfuse.fusion.refine.distill_ensemble``, which keeps the best state including the start: when the
clients agree with their average (e.g. copies of one model) FedDF returns the average (fixed point).

It is the standard anchor for "a server with unlabeled data": fedfuse's fusion strategies are compared
against it (``simulations/``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.permute.maps import load_plain
from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble
from fedfuse.fusion.registry import register


@dataclass(frozen=True)
class FedDFOptions(DistillRefineOptions):
    """Options of ``feddf``: the distillation step's (``DistillRefineOptions``: epochs, lr, batch_size,
    temperature, holdout, patience), with the paper's Adam lr 1e-3 and early stopping."""


@register("feddf", options=FedDFOptions, needs_data=True, any_module=True)
def fuse_feddf(models, *, fusion_inputs, scores, weights, device, seed, options: FedDFOptions,
               info: dict) -> nn.Module:
    """Average the same-architecture ``models`` with ``weights``, then distil their weighted ensemble into
    the average on ``fusion_inputs [B, *input]`` (early stopping on a held-out part). Returns a CPU model."""
    student = copy.deepcopy(models[0]).cpu()
    load_plain(student, average_state_dicts([m.state_dict() for m in models], weights))
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    info.update(distill_ensemble(student.to(device), teachers, weights, fusion_inputs, options, seed=seed,
                                 device=device))
    return student.cpu().eval()
