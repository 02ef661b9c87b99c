"""fedfuse ClientApp: train locally on this node's data, score neurons when asked, reply.

Its replies follow the reply contract of ``fedfuse.flower.round.replies`` and are built by the same helper a
user's own ClientApp uses (``fedfuse.flower.round.replies.make_train_reply``). Reply of a ``train`` message
(``RecordDict``):
- the trained weights (``ArrayRecord`` of the model's state dict) under the name the global model arrived in
  (the strategy's ``arrayrecord_key``, ``"arrays"`` by default);
- ``"importance"``: one score vector per fusion level (``ArrayRecord``), only when the train config says
  ``need-importance`` (the strategy's method reads client scores);
- ``"metrics"``: num-examples, partition-id, train/val accuracy and loss, train-seconds and score-seconds;
  ``class-counts`` (per-class training counts: the label distribution) only when the train config says
  ``need-class-counts``.

Where the data comes from (node-config):
- ``data-path``: this node's own file (``fedfuse.data.node_data``: ``x_train``/``y_train`` [+ ``x_val``/``y_val``]),
  preprocessed like the run's ``dataset``; nothing else is loaded. For deployments with private data.
- otherwise partition ``partition-id`` of ``num-partitions`` of the run's public ``dataset``
  (``data-root`` may point at this node's copy); ``num-partitions`` must equal the run's ``num-clients``.

In ``one-shot`` mode (and round 1 of ``warm-start``, whose train config says ``mode='one-shot'``) the client ignores
the received weights and trains its own independently initialised model (the papers' setting: fuse once, models from
different initialisations), or, with node-config ``model-path`` (a ``.pt`` state dict of the run's architecture),
replies with that model as it is, untrained: an institution that arrives with its own model.

``make_client_app(mods=[...])`` builds the same app with Flower mods around every handler.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoid OpenMP spin-waits on shared cores

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.clientapp.typing import Mod  # noqa: E402

from fedfuse.config import (RunConfig, config_notes, dataset_info, load_initial_model, parse_once,  # noqa: E402
                            partition_file)
from fedfuse.data.node_data import load_node_data  # noqa: E402
from fedfuse.fusion import client_statistics  # noqa: E402
from fedfuse.fusion.stack import is_stacked_state, model_for_state, stacked_from_state  # noqa: E402
from fedfuse.flower.aggregators.candidates import (ACTION as SCORE_ACTION, read_score_query, read_score_site,  # noqa: E402
                                       read_score_tier, score_reply_content)
from fedfuse.flower.round.replies import make_train_reply, read_train_message  # noqa: E402
from fedfuse.flower.round.replies import METRICS_KEY, PARTITION_PREFIX  # noqa: E402
from fedfuse.flower.head.head_messages import (ACTION as HEAD_ACTION, head_reply_content, read_head_dp_clip, read_head_query,  # noqa: E402
                                       read_head_sites, read_head_tier_sites, read_head_tiers,
                                       tier_site)
from fedfuse.flower.trust.privacy import dp_clipping_mod  # noqa: E402
from fedfuse.flower.trust.privacy import (CLIP as SECURE_CLIP, PROJECTION as SECURE_PROJECTION,  # noqa: E402
                                       PROJECTION_K as SECURE_PROJECTION_K, fitins_task, secagg_if_flagged,
                                       task_model_state, task_reply)
from fedfuse.privacy import private_head_statistics  # noqa: E402
from fedfuse.progressive import SiteView, head_sites, head_statistics  # noqa: E402
from fedfuse.flower.tiers.client_tiers import (TIER_KEY, depth_tier, query as tier_query, tier_forward,  # noqa: E402
                                         tier_model)
from fedfuse.task import client_init_seed, client_round, federated_data, global_model  # noqa: E402
from fedfuse.training import evaluate, limit_threads, resolve_device  # noqa: E402
from torch import nn  # noqa: E402


@dataclasses.dataclass
class NodeData:
    """This node's task and data: ``train``/``val`` ArrayDatasets (x [N, *input_shape], y [N])."""

    pid: int
    num_classes: int
    input_shape: tuple[int, ...]
    train: object
    val: object


def _node(context: Context, cfg: RunConfig) -> tuple[int, int]:
    try:
        pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise ValueError("node-config needs 'partition-id' and 'num-partitions' "
                         "(flower-supernode --node-config \"partition-id=0 num-partitions=2\")") from exc
    if n != cfg.num_clients:
        raise ValueError(f"node-config num-partitions={n} but run-config num-clients={cfg.num_clients}: every "
                         f"SuperNode must be started with num-partitions equal to the run's num-clients (or run "
                         f"with num-clients={n})")
    if not 0 <= pid < n:
        raise ValueError(f"node-config partition-id={pid} is not in [0, num-partitions={n})")
    return pid, n


def _node_local_data(cfg: RunConfig, pid: int, path: str, key: str = "node-config 'data-path'") -> NodeData:
    """The node's own file (node-config ``data-path`` or run-config ``partition-files``), checked against the run's
    dataset; a ``ValueError`` naming ``key``."""
    info = dataset_info(cfg.dataset)
    if info is None:
        raise ValueError(f"{key} needs a dataset whose classes and input shape are known without "
                         f"loading it; run-config dataset={cfg.dataset!r} is not one (use a named dataset)")
    try:
        train_set, val_set = load_node_data(path, num_classes=info.num_classes, info=info, dataset=cfg.dataset,
                                            val_fraction=cfg.val_fraction, seed=cfg.seed * 1009 + pid)
    except ValueError as exc:
        raise ValueError(f"{key} ({path}): {exc}") from None
    return NodeData(pid, info.num_classes, tuple(info.input_shape), train_set, val_set)


def _setup(context: Context) -> tuple[RunConfig, NodeData]:
    limit_threads()
    with config_notes():   # what the check resolved (ConfigNote) is the ServerApp's to say, once
        cfg = parse_once(context.run_config)   # parsed on the run's first message only
    if context.node_config.get("data-root"):  # deployment: this SuperNode's own data folder
        cfg = dataclasses.replace(cfg, data_root=str(context.node_config["data-root"]))
    if context.node_config.get("device"):  # deployment: this SuperNode's device (auto | cpu | cuda | cuda:N)
        cfg = dataclasses.replace(cfg, device=str(context.node_config["device"]))
    pid, n = _node(context, cfg)
    if context.node_config.get("data-path"):  # deployment with private data: this node's own file only
        return cfg, _node_local_data(cfg, pid, str(context.node_config["data-path"]))
    if cfg.partition_files:  # simulation from given splits: exactly this client's file
        return cfg, _node_local_data(cfg, pid, partition_file(cfg, pid), key="run-config key 'data-options.partition-files'")
    data = federated_data(cfg, num_clients=n)
    train_set, val_set = data.client_data(pid, cfg.val_fraction, cfg.seed)
    return cfg, NodeData(pid, data.num_classes, tuple(data.input_shape), train_set, val_set)


def train(msg: Message, context: Context) -> Message:
    task = fitins_task(msg)
    if task is not None:   # secure-aggregation=true: the head round's statistics through Flower's SecAgg+
        return secure_head_task(msg, context, task)
    cfg, node = _setup(context)
    request = read_train_message(msg)
    config = request.config
    one_shot = str(config.get("mode", cfg.mode)) == "one-shot"
    model = global_model(cfg, node.num_classes, node.input_shape,
                         seed=client_init_seed(cfg, node.pid) if one_shot else None)
    # capacity tiers: the width the strategy sends (fedfuse.flower.tiers.client_tiers); unchanged without tiers
    base = model
    model = tier_model(model, config, seed=client_init_seed(cfg, node.pid), input_shape=node.input_shape)
    # depth tiers: the node's blocks and exits, DepthFL's loss over them (fedfuse.flower.tiers.client_tiers.depth_tier)
    round_seed = cfg.seed * 7919 + node.pid * 131 + request.server_round
    model, loss_fn, held = depth_tier(model, config, None if one_shot else request.state_dict(), base=base,
                                      seed=round_seed, input_shape=node.input_shape)
    if not one_shot and held is None:
        model.load_state_dict(request.state_dict())
    # one-shot / warm start at an institution that already has its model (node-config model-path): reply with it as it
    # is, untrained here
    own_model = str(context.node_config.get("model-path", "")) if one_shot else ""
    if own_model:
        load_initial_model(own_model, model, key="node-config key 'model-path'")
    forward = tier_forward(base, model, config, seed=round_seed, input_shape=node.input_shape)
    if getattr(forward, "sandwich", False):   # ordered dropout's sandwich rule: its own loss over two widths
        forward, loss_fn = None, forward.loss
    device = resolve_device(cfg.device)
    out = client_round(cfg, model, node.train, node.val, need_importance=request.need_importance,
                       device=device, seed=round_seed, forward=forward,
                       epochs=0 if own_model else int(config["local-epochs"]) if "local-epochs" in config else None,
                       lr=float(config["lr"]) if "lr" in config else None,
                       # FedProx (Flower's strategy sends only mu): proximal term to the received global model, which
                       # a one-shot client (warm start's round 1) does not start from
                       proximal_mu=0.0 if one_shot else float(config.get("proximal-mu", 0.0)), loss_fn=loss_fn)
    if held is not None:   # a depth tier replies with the arrays it holds
        out["state"] = {k: out["state"][k] for k in held}
    metrics = dict(out["metrics"])
    class_counts = metrics.pop("class-counts")   # sent only when the strategy asks (privacy by default)
    num_examples = metrics.pop("num-examples")
    statistics = None
    if request.need_statistics:   # the round's fusion method reads them (RegMean, Fisher merging): on this node's data
        statistics = client_statistics(request.fusion_method, model, node.train.x, node.train.y, device=device)
    content = make_train_reply(out["state"], num_examples=num_examples, train_metrics=metrics,
                               need_importance=request.need_importance, scores=out["scores"],
                               class_counts=class_counts if request.need_class_counts else None,
                               partition_id=node.pid, arrays_key=request.arrays_key, weight_key=request.weight_key,
                               statistics=statistics)
    return Message(content=content, reply_to=msg)


def evaluate_handler(msg: Message, context: Context) -> Message:
    cfg, node = _setup(context)
    request = read_train_message(msg)  # same layout: the global weights + config
    model = model_for_state(lambda: global_model(cfg, node.num_classes, node.input_shape), request.state_dict())
    eval_set = node.val if len(node.val) > 0 else node.train
    m = evaluate(model, eval_set.x, eval_set.y, num_classes=node.num_classes, device=resolve_device(cfg.device))
    metrics = MetricRecord({"num-examples": len(eval_set), "eval-accuracy": float(m["accuracy"]),
                            "eval-loss": float(m["loss"]), "partition-id": node.pid})
    return Message(content=RecordDict({METRICS_KEY: metrics}), reply_to=msg)


def score_handler(msg: Message, context: Context) -> Message:
    """Score the candidate global models of a ``strategy='auto'`` round (``fedfuse.flower.aggregators.candidates``): each one's
    accuracy and loss on this node's validation split, or its training data when it keeps none."""
    cfg, node = _setup(context)
    states = read_score_query(msg)
    tier = read_score_tier(msg)
    model = _tier_model(cfg, node, tier)
    site = read_score_site(msg)   # a depth tier's exit: scored as the model of that depth
    data = node.val if len(node.val) > 0 else node.train
    device = resolve_device(cfg.device)
    accs, losses = [], []
    for state in states:
        if is_stacked_state(state):   # a one-shot stack's candidate heads: its members rebuilt
            held = stacked_from_state(lambda: _tier_model(cfg, node, tier), state)
        else:
            held = model
            held.load_state_dict(state)
        scored = held if site is None else SiteView(held, site)
        m = evaluate(scored, data.x, data.y, num_classes=node.num_classes, device=device)
        accs.append(float(m["accuracy"]))
        losses.append(float(m["loss"]))
    return Message(content=score_reply_content(len(data), accs, losses), reply_to=msg)


def head_handler(msg: Message, context: Context) -> Message:
    """The head round of ``head-round=true`` (``fedfuse.flower.head.head_round``): this node's ridge statistics on
    the fused model's frozen pre-logit features (its training data; no training, no weights sent)."""
    cfg, node = _setup(context)
    model = model_for_state(lambda: global_model(cfg, node.num_classes, node.input_shape), read_head_query(msg))
    # the classifiers asked for, else every one the model has (a depth tier's exits too: forward passes of the global
    # model, no training); an unknown one raises, which Flower returns as an error reply
    sites = read_head_sites(msg) or list(head_sites(model))
    device = resolve_device(cfg.device)
    clip, projection = read_head_dp_clip(msg)
    if clip is not None:   # a DP run: bounded per-client mean statistics (fedfuse.privacy), one classifier
        stats = {site: private_head_statistics(model, node.train.x, node.train.y, node.num_classes, clip,
                                               device=device, site=site, projection=projection) for site in sites}
        return Message(content=head_reply_content(stats), reply_to=msg)
    stats = {site: head_statistics(model, node.train.x, node.train.y, node.num_classes, device=device, site=site)
             for site in sites}
    tier_sites = read_head_tier_sites(msg)
    for r, state in read_head_tiers(msg).items():   # width tiers: every narrower tier's classifier(s) too
        tier = _tier_model(cfg, node, r)
        tier.load_state_dict(state)
        for site in tier_sites[r]:
            stats[tier_site(r, site)] = head_statistics(tier, node.train.x, node.train.y, node.num_classes,
                                                        device=device, site=site)
    return Message(content=head_reply_content(stats), reply_to=msg)


def secure_head_task(msg: Message, context: Context, task: dict) -> Message:
    """The head round's bounded statistics (``fedfuse.privacy``) as a SecAgg+ task's answer
    (``fedfuse.flower.trust.privacy``): the packed Gram matrix and the cross term, masked by ``secaggplus_mod``."""
    cfg, node = _setup(context)
    model = global_model(cfg, node.num_classes, node.input_shape)
    model.load_state_dict(task_model_state(msg, model.state_dict()))
    k = int(task.get(SECURE_PROJECTION_K, 0))
    projection = None
    if k:
        flat = np.frombuffer(task[SECURE_PROJECTION], dtype=np.float64)
        projection = torch.from_numpy(flat.copy()).reshape(-1, k)
    stats = private_head_statistics(model, node.train.x, node.train.y, node.num_classes, float(task[SECURE_CLIP]),
                                    device=resolve_device(cfg.device), projection=projection)
    return task_reply(msg, [stats.pack().numpy(), stats.cross.numpy().ravel()])


def _tier_model(cfg, node: NodeData, r: float | None) -> nn.Module:
    """The run's architecture, at width tier ``r``'s width when given (as ``train`` builds it; no width scaler:
    these models are scored or summarised, not trained)."""
    model = global_model(cfg, node.num_classes, node.input_shape)
    return model if r is None else tier_model(model, {TIER_KEY: r}, seed=client_init_seed(cfg, node.pid),
                                              input_shape=node.input_shape)


def name_partition_mod(msg: Message, context: Context, call_next) -> Message:
    """Outermost mod: an exception raised while this node handles a message is raised again with the node's partition
    id in front (``fedfuse.flower.round.replies.PARTITION_PREFIX``), so that the server names the partition of a node
    that fails before it ever replied validly (its node id alone says nothing to the user)."""
    try:
        return call_next(msg, context)
    except Exception as exc:   # noqa: BLE001 - raised again, with the partition named
        pid = context.node_config.get("partition-id")
        if pid is None:
            raise
        raise RuntimeError(PARTITION_PREFIX.format(pid=int(pid)) + f"{type(exc).__name__}: {exc}") from exc


def make_client_app(*, mods: list[Mod] | tuple[Mod, ...] = ()) -> ClientApp:
    """fedfuse's ClientApp with Flower ``mods`` (``mod(msg, context, call_next)``) around its handlers, and innermost
    ``fedfuse.flower.trust.privacy.dp_clipping_mod`` (Flower's ``fixedclipping_mod`` in runs with ``dp-clipping='client'``;
    it does nothing otherwise)."""
    # dp_clipping_mod last: Flower's fixedclipping_mod on the update when a DP run clips on the nodes
    client_app = ClientApp(mods=[name_partition_mod, *mods, dp_clipping_mod])
    client_app.train(mods=[secagg_if_flagged])(train)   # SecAgg+ messages (secure-aggregation=true) only
    client_app.evaluate()(evaluate_handler)
    client_app.query()(tier_query)   # capacity tiers: a tier-aware strategy asks each node for its tier
    client_app.query(SCORE_ACTION)(score_handler)   # strategy 'auto': the round's candidates on this node's data
    client_app.query(HEAD_ACTION)(head_handler)   # head-round: ridge statistics for the closed-form head
    return client_app


app = make_client_app()
