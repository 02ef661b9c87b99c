"""Secure sums of the head round's statistics (``secure-aggregation=true``) with Flower's own SecAgg+.

The head round's statistics are sums over the nodes, so the server needs only the federation's sum. Flower 1.41
carries secure aggregation in one place: ``SecAggPlusWorkflow`` (Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Complexity", CCS 2020) with the nodes' ``secaggplus_mod``, written for the legacy workflow
(``LegacyContext``, a legacy ``Strategy``, ``FitIns`` / ``FitRes`` records on the ``TRAIN`` route); the Message API
has no secure aggregation of its own. ``secure_sum`` bridges it from fedfuse's Message-API ServerApp: a scratch
``LegacyContext`` over the run's grid, a legacy ``FedAvg`` that asks every node for one task, and the workflow's
masked, quantised sum; no protocol code of fedfuse's own.

What the nodes send (``fedfuse.flower.client_app``): their bounded statistics (``fedfuse.privacy``: clipped features,
per-client means, every number within [-2, 2], inside SecAgg+'s clipping range of 8), weight 1, so the workflow's
weighted mean times the number of nodes that took part is the sum. The query (the global model, the clip bound,
the projection) rides in the ``FitIns``. Quantisation: SecAgg+'s ``quantization_range`` 2²² over [-8, 8], about
4·10⁻⁶ per node and number. What SecAgg+ assumes: an honest-but-curious server and at least 2 nodes; a node that
lies about its statistics is not seen (the server checks only the sum's shape and finiteness).
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log

TASK = "fedfuse-task"   # FitIns config: what the node sums
HEAD_TASK = "head-statistics"
CLIP = "dp-clip"
PROJECTION = "dp-projection"   # FitIns config: the projection [d, k], flattened row-major, with PROJECTION_K
PROJECTION_K = "dp-projection-k"
CLIPPING_RANGE = 8.0


class SecureSumError(RuntimeError):
    """Flower's SecAgg+ workflow halted or returned no sum."""


def fitins_task(msg: Message) -> dict[str, Any] | None:
    """The secure-sum task a TRAIN message carries (its ``FitIns`` config), ``None`` for ordinary training."""
    config = msg.content.config_records.get("fitins.config")
    if config is None or config.get(TASK) != HEAD_TASK:
        return None
    return dict(config)


def secagg_if_flagged(msg: Message, context: Context, call_next):
    """The ClientApp's train mod: Flower's ``secaggplus_mod`` on SecAgg+ messages, nothing otherwise."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def task_model_state(msg: Message, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model state a secure-sum task carries (``FitIns`` parameters, in ``template``'s key order)."""
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat

    arrays = parameters_to_ndarrays(compat.recorddict_to_fitins(msg.content, True).parameters)
    if len(arrays) != len(template):
        raise ValueError(f"secure sum: the task carries {len(arrays)} arrays, the model has {len(template)}")
    return {k: torch.as_tensor(np.asarray(a)).reshape(v.shape).to(v.dtype) for (k, v), a in
            zip(template.items(), arrays)}


def task_reply(msg: Message, arrays: list[np.ndarray]) -> Message:
    """A node's answer to a secure-sum task: ``arrays`` as ``FitRes`` parameters, weight 1."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.asarray(a, dtype=np.float64) for a in arrays]),
                 num_examples=1, metrics={})
    return Message(compat.fitres_to_recorddict(res, False), reply_to=msg)


def secure_sum(grid, state: dict[str, torch.Tensor], config: dict[str, Any], timeout: float | None
               ) -> tuple[list[np.ndarray], int]:
    """``(the nodes' arrays summed, how many nodes took part)``: one SecAgg+ round over every node of ``grid``, the
    ``FitIns`` carrying ``state`` (a model's arrays) and ``config``; ``SecureSumError`` when the workflow halts (fewer
    than 2 nodes, too many dropped) or gives no sum. The server sees the sum only."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    nodes = list(grid.get_node_ids())
    if len(nodes) < 2:
        raise SecureSumError(f"secure aggregation needs at least 2 nodes, the federation has {len(nodes)}")

    class _Sum(LegacyFedAvg):   # asks every node for the task and counts the answers the workflow summed
        taken = 0

        def aggregate_fit(self, server_round, results, failures):
            self.taken = len(results)
            return super().aggregate_fit(server_round, results, failures)

    manager = SimpleClientManager()
    for node in nodes:
        manager.register(GridClientProxy(node_id=node, grid=grid, run_id=grid.run.run_id))
    strategy = _Sum(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(nodes),
                    min_available_clients=len(nodes), on_fit_config_fn=lambda _r: dict(config))
    scratch = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
    legacy = LegacyContext(scratch, ServerConfig(num_rounds=1), strategy, manager)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: 1})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([v.detach().cpu().numpy() for v in state.values()]), True)
    SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.67, max_weight=1.0,
                       clipping_range=CLIPPING_RANGE, timeout=timeout)(grid, legacy)
    if not strategy.taken:
        raise SecureSumError("Flower's SecAgg+ workflow halted before summing (see its log: too few nodes answered "
                             "a stage, or a stage timed out)")
    mean = parameters_to_ndarrays(compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD],
                                                                   True))
    log(INFO, "fedfuse secure sum: %d of %d nodes summed with SecAgg+", strategy.taken, len(nodes))
    if strategy.taken < len(nodes):
        log(WARNING, "fedfuse secure sum: %d nodes dropped out of SecAgg+", len(nodes) - strategy.taken)
    return [np.asarray(m, dtype=np.float64) * strategy.taken for m in mean], strategy.taken


__all__ = ["TASK", "HEAD_TASK", "CLIP", "PROJECTION", "PROJECTION_K", "SecureSumError", "fitins_task",
           "secagg_if_flagged", "task_model_state", "task_reply", "secure_sum"]
