"""fedfuse ClientApp: train locally on this node's partition, score neurons, reply.

Its replies follow the reply contract of ``fedfuse.flower.replies``. Reply of a ``train`` message
(``RecordDict``):
- ``"arrays"``: the trained weights (``ArrayRecord`` of the model's state dict);
- ``"importance"``: one score vector per fusion level (``ArrayRecord``; only when the strategy's
  config asks for it with ``need-importance``);
- ``"metrics"``: num-examples, partition-id, class-counts, train/val accuracy and loss,
  train-seconds and score-seconds.

In ``one-shot`` mode the client ignores the received weights and trains its own independently
initialised model (the papers' setting: fuse once, models from different initialisations).

``make_client_app(mods=[...])`` builds the same app with Flower mods around every handler.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoid OpenMP spin-waits on shared cores

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.clientapp.typing import Mod  # noqa: E402

from fedfuse.config import parse_run_config  # noqa: E402
from fedfuse.flower.replies import ARRAYS_KEY, IMPORTANCE_KEY, METRICS_KEY  # noqa: E402
from fedfuse.task import client_init_seed, client_round, federated_data, global_model  # noqa: E402
from fedfuse.training import evaluate, limit_threads, resolve_device  # noqa: E402

def _node(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise ValueError("node-config needs 'partition-id' and 'num-partitions' "
                         "(flower-supernode --node-config \"partition-id=0 num-partitions=2\")") from exc


def _setup(context: Context):
    limit_threads()
    cfg = parse_run_config(context.run_config)
    if context.node_config.get("data-root"):  # deployment: this SuperNode's own data folder
        cfg = dataclasses.replace(cfg, data_root=str(context.node_config["data-root"]))
    if context.node_config.get("device"):  # deployment: this SuperNode's device (auto | cpu | cuda | cuda:N)
        cfg = dataclasses.replace(cfg, device=str(context.node_config["device"]))
    pid, n = _node(context)
    data = federated_data(cfg, num_clients=n)
    train_set, val_set = data.client_data(pid, cfg.val_fraction, cfg.seed)
    return cfg, pid, data, train_set, val_set


def train(msg: Message, context: Context) -> Message:
    cfg, pid, data, train_set, val_set = _setup(context)
    config = msg.content["config"]
    server_round = int(config.get("server-round", 1))
    one_shot = str(config.get("mode", cfg.mode)) == "one-shot"
    model = global_model(cfg, data.num_classes, data.input_shape,
                         seed=client_init_seed(cfg, pid) if one_shot else None)
    if not one_shot:
        model.load_state_dict(msg.content[ARRAYS_KEY].to_torch_state_dict())
    device = resolve_device(cfg.device)
    out = client_round(cfg, model, train_set, val_set, need_importance=bool(config.get("need-importance", False)),
                       device=device, seed=cfg.seed * 7919 + pid * 131 + server_round,
                       epochs=int(config["local-epochs"]) if "local-epochs" in config else None,
                       lr=float(config["lr"]) if "lr" in config else None,
                       # FedProx (Flower's strategy sends only mu): proximal term to the received global model
                       proximal_mu=float(config.get("proximal-mu", 0.0)))
    content = RecordDict({ARRAYS_KEY: ArrayRecord(out["state"])})
    if out["scores"] is not None:
        content[IMPORTANCE_KEY] = ArrayRecord({k: v.detach().cpu().float().contiguous()
                                               for k, v in out["scores"].items()})
    content[METRICS_KEY] = MetricRecord({**out["metrics"], "partition-id": pid})
    return Message(content=content, reply_to=msg)


def evaluate_handler(msg: Message, context: Context) -> Message:
    cfg, pid, data, train_set, val_set = _setup(context)
    model = global_model(cfg, data.num_classes, data.input_shape)
    model.load_state_dict(msg.content[ARRAYS_KEY].to_torch_state_dict())
    eval_set = val_set if len(val_set) > 0 else train_set
    m = evaluate(model, eval_set.x, eval_set.y, num_classes=data.num_classes, device=resolve_device(cfg.device))
    metrics = MetricRecord({"num-examples": len(eval_set), "eval-accuracy": float(m["accuracy"]),
                            "eval-loss": float(m["loss"]), "partition-id": pid})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def make_client_app(*, mods: list[Mod] | tuple[Mod, ...] = ()) -> ClientApp:
    """fedfuse's ClientApp with Flower ``mods`` (``mod(msg, context, call_next)``) around its handlers."""
    client_app = ClientApp(mods=list(mods))
    client_app.train()(train)
    client_app.evaluate()(evaluate_handler)
    return client_app


app = make_client_app()
