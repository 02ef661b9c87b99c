"""fedfuse ServerApp: central data, the chosen strategy, per-round evaluation and results.

Every round: the strategy sends the global model (multi-round) or a start signal (one-shot), fuses
the validated replies with ``fedfuse.fusion``, and ``evaluate_fn`` scores the new global model on the
test split (accuracy, loss, per-class accuracy), together with the reference ensemble of that
round's client models and each client model alone. Results go to ``<output-dir>/<run-name>/``:
``config.json``, ``results.json`` and ``rounds.csv`` (one row per round), ``accuracy.png``,
``global_model.pt``.

Failures are never silent: a round whose fusion fell back (``fedfuse.fusion.FusionError``) is a WARNING
line, a ``"fallback"`` entry of its results row and a red marker on the plot; ``results.json`` counts
them (``"fallbacks"``, ``"fallback-rounds"``). A run in which fusion never succeeded (every aggregation
round fell back or was skipped), or that raised, ends with ``"status": "failed"`` and ``"error"`` in
``results.json`` and then raises, so ``flwr run`` reports the run as failed.

``make_server_app(wrap_strategy=...)`` builds the same app with the strategy wrapped (e.g. by a
Flower wrapper strategy); ``run_server`` is its body, for apps that prepare the ``Context`` first.

Checkpoint and resume: after every round the global model and the run state (last completed round,
rows so far, strategy history) are written atomically to ``<out>/checkpoint/``. A run started again
with ``resume=true`` and the same ``run-name``/``output-dir`` continues from the last completed round:
only the remaining rounds run, with the true round numbers (client seeds, fusion seeds and result rows
match an uninterrupted run).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoid OpenMP spin-waits on shared cores

import resource  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from datetime import datetime  # noqa: E402
from logging import ERROR, INFO, WARNING  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord  # noqa: E402
from flwr.common.logger import log  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from typing import Any, Callable  # noqa: E402

from flwr.serverapp.strategy import Strategy  # noqa: E402

from fedfuse.config_layout import path_of  # noqa: E402
from fedfuse.config import (ConfigError, RunConfig, config_notes, dataset_info, load_initial_model,  # noqa: E402
                            preflight, read_fusion_set, SELECTING_STRATEGIES)
from fedfuse.plan import auto_candidate_refine, auto_candidates, auto_server_momentum, make_plan  # noqa: E402
from fedfuse.data.fusion_set import ServerData  # noqa: E402
from fedfuse.data.sources import ArrayDataset  # noqa: E402
from fedfuse.flower.round.divergence import guard_broadcast  # noqa: E402
from fedfuse.fusion.stack import model_for_state  # noqa: E402
from fedfuse.flower.head.head_step import HeadRoundOptions, HeadRoundStep, ensemble_reference  # noqa: E402
from fedfuse.flower.trust.privacy import PrivacyAccount, compose_runner, head_privacy, private_config  # noqa: E402
from fedfuse.flower.strategies import STRATEGIES  # noqa: E402
from fedfuse.flower.aggregators.baselines import baseline_options  # noqa: E402
from fedfuse.flower.trust.screen import ClientScreen  # noqa: E402
from fedfuse.flower.round.protocol import RoundProtocol  # noqa: E402
from fedfuse.flower.aggregators.warm_start import WarmStart  # noqa: E402
from fedfuse.strategy_specs import MEAN_METHODS  # noqa: E402
from fedfuse.flower.strategies import strategy_builder  # noqa: E402
from fedfuse.hetero import tier_name  # noqa: E402
from fedfuse.references import REFERENCE_LABELS, one_shot_references  # noqa: E402
from fedfuse.results import (RunRecorder, dead_model, fusion_outcome, head_round_row, load_checkpoint,  # noqa: E402
                             privacy_text, rounds_text, save_checkpoint)
from fedfuse.run_control import RunFolderBusy, app_run_folder  # noqa: E402
from fedfuse.task import federated_data, global_model, load_fusion_inputs  # noqa: E402
from fedfuse.training import evaluate, limit_threads, metrics_from_logits, predict_logits, resolve_device  # noqa: E402

StrategyWrapper = Callable[[RoundProtocol, Context], Strategy]


def output_dir(cfg: RunConfig) -> Path:
    """``<output-dir>/<run-name>``; a relative output-dir is taken from ``FEDFUSE_OUTPUT_ROOT`` or the cwd."""
    base = Path(cfg.output_dir).expanduser()
    if not base.is_absolute():
        base = Path(os.environ.get("FEDFUSE_OUTPUT_ROOT", os.getcwd())) / base
    model = cfg.model.replace(":", "-")   # a zoo model's 'timm:<name>': no colon in the folder name
    name = cfg.run_name or (f"{cfg.strategy}-{cfg.dataset}-{model}-{cfg.partitioning}-{cfg.mode}-s{cfg.seed}-"
                            f"{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return base / name


def server_files(cfg: RunConfig):
    """``fedfuse.data.fusion_set.ServerData`` from the server's own files only (``fusion-set-path`` and
    ``test-set-path``; without a test set, ``evaluation='federated'``: ``test`` is ``None``): no dataset is loaded
    (deployment where every client holds its data, node-config ``data-path``). ``ConfigError`` naming the key."""
    info = dataset_info(cfg.dataset)
    if info is None:
        raise ConfigError(f"run-config key 'data-options.test-set-path': dataset {cfg.dataset!r} has no known input shape and "
                          "classes before loading; use a named dataset or leave data-options.test-set-path empty")
    shape, classes = tuple(info.input_shape), info.num_classes
    fx = fy = None
    if cfg.fusion_set_path:
        fx, fy = read_fusion_set(cfg.fusion_set_path, dataset=cfg.dataset, input_shape=shape, num_classes=classes)
        if cfg.partition_files and len(fx) > cfg.fusion_set_size:
            # a public pool: the fusion set is fusion-set-size samples drawn from it (seeded by the run seed)
            idx = torch.randperm(len(fx), generator=torch.Generator().manual_seed(cfg.seed))[:cfg.fusion_set_size]
            fx, fy = fx[idx], (fy[idx] if fy is not None else None)
    test = None
    if cfg.test_set_path:
        tx, ty = read_fusion_set(cfg.test_set_path, dataset=cfg.dataset, input_shape=shape, num_classes=classes,
                                 key="test-set-path")
        test = ArrayDataset(tx, ty, classes)
    return ServerData(test=test, fusion_x=fx, fusion_y=fy, num_classes=classes,
                      input_shape=shape)


def setup(cfg: RunConfig):
    """Data, fusion set, architecture and strategy for a validated config (no Flower messaging)."""
    # with the server's files (fusion set, and a test set unless evaluation is federated only) the server needs no
    # dataset (the clients hold theirs); else the dataset's splits
    own_files = (cfg.fusion_set_path or cfg.partition_files) and (cfg.test_set_path or cfg.evaluation == "federated")
    data = server_files(cfg) if own_files else federated_data(cfg)
    if cfg.test_set_path and not own_files:
        from dataclasses import replace

        tx, ty = read_fusion_set(cfg.test_set_path, dataset=cfg.dataset, input_shape=tuple(data.input_shape),
                                 num_classes=data.num_classes, key="test-set-path")
        data = replace(data, test=ArrayDataset(tx, ty, data.num_classes))
    fusion_x, fusion_y = data.fusion_x, getattr(data, "fusion_y", None)
    if fusion_x is not None and len(fusion_x) == 0:   # public-fraction=0: no fusion set (a run that only averages)
        fusion_x = fusion_y = None
    if cfg.fusion_set_path and not own_files:
        # the same checks as the preflight, now against the loaded data's shape (hf:<name> is only known here)
        fusion_x, fusion_y = load_fusion_inputs(cfg.fusion_set_path, dataset=cfg.dataset,
                                                input_shape=tuple(data.input_shape), num_classes=data.num_classes)

    def model_fn() -> torch.nn.Module:
        return global_model(cfg, data.num_classes, data.input_shape)

    make, tier_options = strategy_builder(cfg, data.input_shape)   # capacity tiers: fedfuse.flower.tiers.tiered
    strategy = make(cfg.strategy, model_fn=model_fn, fusion_options=dict(cfg.fusion_options_table), **tier_options,
                              fusion_inputs=fusion_x, fusion_labels=fusion_y,
                              fraction_train=cfg.fraction_train, min_train_nodes=cfg.min_train_nodes,
                              min_available_nodes=cfg.min_train_nodes, min_valid_replies=cfg.min_train_nodes,
                              fallback=cfg.fusion_fallback, device=cfg.device, seed=cfg.seed,
                              fusion_rounds=cfg.fusion_rounds,
                              refine=None if cfg.refine == "auto" else cfg.refine, prior=cfg.refine_prior,
                              # one-shot: the clients start from independent initialisations, so the weighted average
                              # the guard falls back to is no model (it would replace a good fused model by one at
                              # chance); the guard is a multi-round safeguard
                              guard=cfg.divergence_guard and cfg.mode != "one-shot",
                              **federated_evaluation_options(cfg), **selection_options(cfg),
                              **({"align_to": cfg.align_to} if cfg.align_to != "model-0" else {}),
                              **baseline_options(cfg.strategy, server_lr=cfg.server_lr,
                                                 server_momentum=None if cfg.server_momentum < 0 else cfg.server_momentum,
                                                 proximal_mu=cfg.proximal_mu, trim_beta=cfg.trim_beta,
                                                 num_malicious_nodes=cfg.num_malicious_nodes,
                                                 num_nodes_to_select=cfg.num_nodes_to_select),
                              # the robust setting: the update screen where the clients train from the global model,
                              # and in one-shot runs the clients' answers to the queries only (a ConfigNote says so)
                              **({"screen": ClientScreen(cluster=cfg.robust_cluster,
                                                          min_samples=cfg.robust_cluster_min_samples,
                                                          cosine_mads=cfg.robust_cosine_mads)}
                                 if cfg.robust and cfg.mode != "one-shot" else {}),
                              **({"robust_answers": True} if cfg.robust else {}))
    return data, model_fn, strategy


class FederatedEvaluation:
    """Flower's federated evaluation as fedfuse reports it: the ``evaluate_metrics_aggr_fn`` of the strategy
    (``FedAvg.aggregate_evaluate`` hands it the valid evaluate replies of a round) that keeps each client's
    ``eval-accuracy`` / ``eval-loss`` (fedfuse's ClientApp: the global model on its validation split) and returns
    their sample-weighted means; ``take()`` gives the round's numbers to the results row (Flower evaluates the
    clients before it calls the central ``evaluate_fn`` of the same round)."""

    def __init__(self) -> None:
        self.pending: dict | None = None

    def __call__(self, contents: list, weighted_by_key: str) -> MetricRecord:
        clients = []
        for content in contents:
            rec = next(iter(content.metric_records.values()), {})
            if all(k in rec for k in (weighted_by_key, "eval-accuracy", "eval-loss")):
                clients.append({"partition-id": rec.get("partition-id"), "num-examples": int(rec[weighted_by_key]),
                                "accuracy": float(rec["eval-accuracy"]), "loss": float(rec["eval-loss"])})
        total = sum(c["num-examples"] for c in clients)
        if not total:
            self.pending = {"federated-clients": 0}
            return MetricRecord({"federated-clients": 0})
        acc = sum(c["accuracy"] * c["num-examples"] for c in clients) / total
        loss = sum(c["loss"] * c["num-examples"] for c in clients) / total
        self.pending = {"federated-accuracy": acc, "federated-loss": loss, "federated-clients": len(clients),
                        "federated-examples": total,
                        "client-federated-accuracy": {str(c["partition-id"] if c["partition-id"] is not None else i):
                                                      c["accuracy"] for i, c in enumerate(clients)}}
        return MetricRecord({"federated-accuracy": acc, "federated-loss": loss, "federated-clients": len(clients)})

    def take(self) -> dict:
        out, self.pending = self.pending or {}, None
        return out


class MemberReference:
    """The per-client reference columns of a round (``ensemble-accuracy``, ``client-<p>-test-accuracy``, client
    metric means), collected while the strategy validates each reply (``RoundProtocol.update_observer``): the
    member's test logits are computed then and its weights dropped, so a streaming aggregation (``average``,
    ``fedavg``) need not keep the round's client models for this reference."""

    def __init__(self, build_model: Callable[[dict], Any], test_x: Any, device: Any, keep_models: bool = False) -> None:
        self.build_model, self.test_x, self.device = build_model, test_x, device
        self.members: list[tuple[int, Any, dict]] = []   # (partition id, test logits or None, metrics)
        # one-shot references (fedfuse.references): the round's client models and sample counts, kept only then
        self.keep_models = keep_models
        self.models: list[tuple[Any, int]] = []

    def __call__(self, update: Any) -> None:
        model = self.build_model(update.state) if self.test_x is not None or self.keep_models else None
        logits = predict_logits(model, self.test_x, device=self.device) if self.test_x is not None else None
        self.members.append((update.partition_id, logits, dict(update.metrics)))
        if self.keep_models:
            self.models.append((model, int(update.num_examples)))

    def take(self) -> list[tuple[int, Any, dict]]:
        out, self.members = self.members, []
        return out

    def take_models(self) -> list[tuple[Any, int]]:
        """The kept ``(model, sample count)`` of the members taken last (``keep_models``), in the same order."""
        out, self.models = self.models, []
        return out


def selection_options(cfg: RunConfig) -> dict:
    """Strategy ``auto``'s options from the run's plan (``fedfuse.plan``: its candidates, the local epochs that decide
    whether fusion candidates are built, the momentum of its every-round momentum step); ``{}`` for any other
    strategy."""
    if cfg.strategy not in SELECTING_STRATEGIES:
        return {}
    out = {"candidates": auto_candidates(cfg), "local_epochs": None if cfg.mode == "one-shot" else cfg.local_epochs,
           "fusion_min_epochs": cfg.auto_fusion_epochs, "candidate_refine": auto_candidate_refine(cfg),
           "one_shot": cfg.mode == "one-shot"}
    momentum = auto_server_momentum(cfg)
    if momentum is not None:   # else baseline_options passes the user's value
        out["server_momentum"] = momentum
    return out


def federated_evaluation_options(cfg: RunConfig) -> dict:
    """FedAvg options of the strategy for ``cfg.evaluation``: every node evaluates the global model each round
    (``fraction_evaluate=1``) with ``evaluation`` ``federated``/``both``; none with ``central``."""
    if cfg.evaluation == "central":
        return {"fraction_evaluate": 0.0}
    return {"fraction_evaluate": 1.0, "min_evaluate_nodes": cfg.min_train_nodes,
            "evaluate_metrics_aggr_fn": FederatedEvaluation()}


def _current_rss_mb() -> float | None:
    """The server process's resident set now (MiB; Linux ``/proc``, ``None`` elsewhere): unlike the peak it can fall,
    so rounds show whether the server's memory grows with the rounds or the registered clients."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return None


def server_data_digest(fusion_x, fusion_y, test) -> dict[str, str | None]:
    """SHA-256 of the server's fusion set and test set as loaded (``None`` where there is none): recorded in
    ``results.json`` and the checkpoint, so that a resumed run proves it reads what the interrupted one read (a
    fusion-set file replaced in between would otherwise mix two runs' data without a word)."""
    import hashlib

    def digest(*tensors) -> str | None:
        if tensors[0] is None:
            return None
        h = hashlib.sha256()
        for t in tensors:
            if t is not None:
                t = torch.as_tensor(t).detach().cpu().contiguous()
                h.update(str((tuple(t.shape), str(t.dtype))).encode())
                h.update(t.numpy().tobytes())
        return h.hexdigest()

    return {"fusion-set-sha256": digest(fusion_x, fusion_y),
            "test-set-sha256": None if test is None else digest(getattr(test, "x", None), getattr(test, "y", None))}


def check_server_data(saved: dict | None, now: dict, out: Path, cfg: RunConfig) -> None:
    """``ConfigError`` naming the setting when a resumed run's fusion set or test set is not the checkpointed run's."""
    if not saved:   # a checkpoint written before digests were recorded: nothing to compare
        return
    keys = {"fusion-set-sha256": "fusion-set-path" if cfg.fusion_set_path else "dataset",
            "test-set-sha256": "data-options.test-set-path" if cfg.test_set_path else "dataset"}
    for field, key in keys.items():
        if saved.get(field) != now.get(field):
            raise ConfigError(f"run-config key {key!r}: the server's {field.split('-sha')[0].replace('-', ' ')} is not "
                              f"the one the checkpointed run in {out} used (sha256 {str(saved.get(field))[:12]} then, "
                              f"{str(now.get(field))[:12]} now; was its file replaced?): resuming would mix two runs' "
                              "data; restore it, or start a fresh run (resume=false)")


# run-config keys that may differ between an interrupted run and its resumption
RESUME_MAY_DIFFER = ("resume", "num-server-rounds", "strategy-options.round-timeout", "device")


def _resume_state(cfg: RunConfig, out: Path):
    """``(done rounds, run state, global state dict)`` from ``<out>/checkpoint``, or ``None``."""
    if not cfg.resume:
        return None
    loaded = load_checkpoint(out)
    if loaded is None:
        log(WARNING, "fedfuse: resume=true but %s has no checkpoint; starting from round 0", out / "checkpoint")
        return None
    run_state, state = loaded
    saved = {path_of(k): v for k, v in run_state.get("config", {}).items()}   # a checkpoint of the flat layout too
    now = cfg.to_dict()
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUME_MAY_DIFFER and saved.get(k) != now.get(k))
    if differ:
        raise ConfigError(f"run-config keys {differ} differ from the checkpointed run in {out}; resume needs the "
                          "same configuration")
    return int(run_state["round"]), run_state, state


def warm_start(cfg: RunConfig, strategy: RoundProtocol, out: Path) -> WarmStart:
    """The ``WarmStart`` of a ``mode='warm-start'`` run (its clients' round-1 models go to ``<out>/warm-start``);
    ``ConfigError`` naming the key when the server lacks what its fusion needs."""
    warm = WarmStart(fusion=cfg.warm_start_fusion, options=dict(cfg.warm_start_fusion_options_table),
                     epochs=cfg.warm_start_epochs,
                     lr=cfg.warm_start_lr if cfg.warm_start_lr > 0 else None, save_dir=out / "warm-start",
                     depth_tiers=bool(cfg.depth_tiers))
    try:
        warm.check_server(strategy.fusion_inputs, strategy.fusion_labels)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return warm


def check_run_config(context: Context, notes: list[str] | None = None) -> RunConfig:
    """The validated run config (``fedfuse.config.preflight``: keys, types, ranges, combinations, the files
    it names, the model); raises ``ConfigError`` naming the key before any client is contacted. What the check
    resolved for the user (``fedfuse.config.ConfigNote``: e.g. the tiered default for 'auto') is logged here, once
    per run, as a WARNING (shown on the console) and appended to ``notes`` (``results.json`` ``"config-notes"``)."""
    with config_notes() as found:
        cfg = preflight(context.run_config, known_strategies=tuple(STRATEGIES))
    for note in found:
        log(WARNING, "fedfuse: %s", note)
    if notes is not None:
        notes.extend(found)
    return cfg


class RoundEvaluation:
    """The run's ``evaluate_fn``: every round, the global model on the server's test set (central evaluation), the
    clients' federated evaluation, the strategy's record of the round, the round's client models as references
    (ensemble, each client, best client), timings; then the round's row, checkpoint and log line."""

    def __init__(self, cfg: RunConfig, data, model_fn: Callable[[], torch.nn.Module], strategy: RoundProtocol,
                 recorder: RunRecorder, out: Path, done: int, initial: dict) -> None:
        self.cfg, self.data, self.model_fn, self.strategy = cfg, data, model_fn, strategy
        self.recorder, self.out, self.done = recorder, out, done
        self.device = resolve_device(cfg.device)
        self.central = cfg.evaluation != "federated"
        self.test_x, self.test_y = (data.test.x, data.test.y) if self.central else (None, None)
        federated = getattr(strategy, "evaluate_metrics_aggr_fn", None)
        self.federated = federated if isinstance(federated, FederatedEvaluation) else None
        self.references = cfg.one_shot_references if cfg.mode == "one-shot" else "none"
        # the members' test logits: the per-round reference columns (client-references) and one-shot's references
        member_x = self.test_x if (cfg.client_references or cfg.mode == "one-shot") else None
        self.reference = MemberReference(strategy.build_model, member_x, self.device,
                                         keep_models=self.references != "none" and self.central)
        strategy.update_observer = self.reference
        self.last_arrays = ArrayRecord(initial)
        self._clock = time.perf_counter()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        server_round += self.done  # true round number when resuming
        self.last_arrays = arrays
        if self.done and server_round == self.done:  # the resumed-from model: its row is in the checkpoint already
            return None
        row: dict[str, Any] = {"round": server_round}
        m = self._central(arrays, row)
        if self.federated is not None and server_round > 0:  # this round's Flower evaluate round
            row.update(self.federated.take())
        if self.central:  # capacity tiers: each tier model (``{}`` for one architecture)
            row.update(self.strategy.evaluate_tiers(server_round, self.test_x, self.test_y, self.device))
        now = time.perf_counter()
        row["round-seconds"] = now - self._clock
        self._clock = t_eval = now
        if server_round > 0:
            row.update(self._strategy_columns(server_round))
            row.update(self._member_columns())
        row["eval-seconds"] = time.perf_counter() - t_eval
        row["server-peak-rss-mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        row["server-rss-mb"] = _current_rss_mb()
        self.recorder.add_round(row)
        if server_round > 0:
            save_checkpoint(self.out, server_round, arrays.to_torch_state_dict(),
                            {"num-server-rounds": self.cfg.num_server_rounds, "config": self.cfg.to_dict(),
                             "rows": self.recorder.rows, "strategy-history": self.strategy.history,
                             "resumed-from-rounds": self.recorder.extra.get("resumed-from-rounds", []),
                             "server-data": self.recorder.extra.get("server-data")})
        _log_round(server_round, row)
        if m is None:
            return None
        return MetricRecord({"test-accuracy": float(m["accuracy"]), "test-loss": float(m["loss"])})

    def _central(self, arrays: ArrayRecord, row: dict[str, Any]) -> dict | None:
        """The global model's test metrics (central evaluation), added to ``row``; ``None`` when federated only."""
        if not self.central:
            return None
        model = model_for_state(self.model_fn, arrays.to_torch_state_dict())   # a one-shot stack: every member
        m = evaluate(model, self.test_x, self.test_y, num_classes=self.data.num_classes, device=self.device)
        row.update({"test-accuracy": m["accuracy"], "test-loss": m["loss"],
                    "per-class-accuracy": m["per-class-accuracy"]})
        return m

    def _strategy_columns(self, server_round: int) -> dict[str, Any]:
        """The strategy's record of the round (replies, rejects, failures, fallback, guard, fusion info)."""
        hist = next((h for h in reversed(self.strategy.history) if h["round"] == server_round), None)
        if hist is None:
            return {}
        out = {"valid-replies": hist.get("valid"), "rejected": hist["rejected"], "failures": hist["failures"],
               "fallback": hist.get("fallback"), "skipped": hist.get("skipped"), "guard": hist.get("guard"),
               "fusion-seconds": hist.get("fusion-seconds"), "fusion-info": hist.get("fusion-info")}
        info = hist.get("fusion-info") or {}
        if info.get("select-choice"):   # strategy 'auto': the round's choice and the clients' scores
            out["choice"] = info["select-choice"]
            scores = info.get("select-accuracy") or {}
            out["choice-scores"] = " ".join(f"{n}={a:.4f}" for n, a in scores.items()) or None
        return out

    def _member_columns(self) -> dict[str, Any]:
        """The round's client models as references: their ensemble's, each one's and the best one's test accuracy
        (central evaluation) and the means of their reported metrics. The members come from the update observer
        (as the strategy validated them), else from the strategy's kept replies."""
        members = self.reference.take()
        kept = self.reference.take_models()
        if not members and self.strategy.last_updates and self.reference.test_x is not None:
            models = [self.strategy.build_model(u.state) if self.central else None for u in self.strategy.last_updates]
            members = [(u.partition_id, predict_logits(m, self.test_x, device=self.device) if self.central else None,
                        u.metrics) for u, m in zip(self.strategy.last_updates, models)]
            kept = [(m, int(u.num_examples)) for u, m in zip(self.strategy.last_updates, models) if m is not None]
        if self.references != "none" and members:
            self._one_shot_references(members, kept)
        out: dict[str, Any] = {}
        if members and self.central and all(lg is not None for _, lg, _ in members):
            member_logits = [lg for _, lg, _ in members]
            w = torch.full((len(members),), 1.0 / len(members))  # the uniform Ensemble's weights
            probs = sum(wi * lg.softmax(-1) for wi, lg in zip((w / w.sum()).tolist(), member_logits))
            out["ensemble-accuracy"] = metrics_from_logits(probs, self.test_y, probabilities=True)["accuracy"]
            out["client-test-accuracy"] = [metrics_from_logits(lg, self.test_y)["accuracy"] for lg in member_logits]
            out["client-partition-ids"] = [pid for pid, _, _ in members]  # rounds.csv client-<p>-... columns
            out["best-client-accuracy"] = max(out["client-test-accuracy"])
        for key in ("train-seconds", "score-seconds", "train-accuracy", "val-accuracy"):
            vals = [m.get(key) for _, _, m in members if isinstance(m.get(key), (int, float))]
            if vals:
                out[f"client-{key}-mean"] = sum(vals) / len(vals)
        return out

    def _one_shot_references(self, members: list[tuple[int, Any, dict]], kept: list[tuple[Any, int]]) -> None:
        """One-shot mode: ``results.json`` ``"one-shot-references"`` (``fedfuse.references``: best and mean client,
        weighted ensemble, weighted average, KD, FedDF) from the round's client models, logged; without a server test
        set (``evaluation='federated'``) the entry says they are unavailable, with a WARNING naming the key."""
        if not self.central:
            reason = ("evaluation='federated': the server holds no test set to evaluate the client models on; use "
                      "evaluation='both' (or 'central') for the one-shot references")
            log(WARNING, "fedfuse: run-config key 'report-options.one-shot-references': unavailable: %s", reason)
            self.recorder.extra["one-shot-references"] = {"unavailable": reason}
            return
        refs = one_shot_references([m for m, _ in kept], [n for _, n in kept], [p for p, _, _ in members],
                                   test_x=self.test_x, test_y=self.test_y, fusion_inputs=self.strategy.fusion_inputs,
                                   device=self.device, seed=self.strategy.seed + 1,
                                   distill=self.references == "all", logits=[lg for _, lg, _ in members])
        self.recorder.extra["one-shot-references"] = refs
        for row in refs["rows"]:
            if "unavailable" in row:
                log(WARNING, "fedfuse: one-shot reference %r unavailable: %s", row["key"], row["unavailable"])
            if "warning" in row:
                log(WARNING, "fedfuse: one-shot reference %r: %s", row["key"], row["warning"])
        log(INFO, "fedfuse: one-shot references (%.1fs): %s", refs["seconds"], ", ".join(
            f"{REFERENCE_LABELS[r['key']]} {r['accuracy']:.4f}" for r in refs["rows"] if "accuracy" in r))


def _log_round(server_round: int, row: dict[str, Any]) -> None:
    log(INFO, "fedfuse round %d: %s%s%s", server_round, ", ".join(
        f"{k} {row[k]:.4f}" for k in ("test-accuracy", "federated-accuracy") if row.get(k) is not None)
        + (f" ({row['federated-clients']} clients)" if "federated-clients" in row else "") or "no evaluation yet",
        f", ensemble {row['ensemble-accuracy']:.4f}" if "ensemble-accuracy" in row else "",
        (f", fusion {row['fusion-seconds']:.2f}s" if row.get("fusion-seconds") is not None else "")
        + (f", auto chose {row['choice']} ({row.get('choice-scores')})" if row.get("choice") else ""))
    if row.get("fallback"):
        log(WARNING, "fedfuse round %d: fusion fell back: %s", server_round, row["fallback"])


def _write_results(cfg: RunConfig, out: Path, strategy: RoundProtocol, recorder: RunRecorder,
                   last_arrays: ArrayRecord, crash: BaseException | None) -> None:
    """``results.json`` (with the run's outcome and the strategy's history), the last global model, the plot and
    ``DONE``; a failed run is logged and raised after its results are written."""
    outcome = fusion_outcome(strategy.history)
    if crash is not None:
        outcome = {**outcome, "status": "failed", "error": f"{type(crash).__name__}: {crash}"}
    elif outcome["status"] == "completed":
        dead = dead_model(recorder.rows, int(recorder.config.get("num-classes", 0)),
                          privacy=recorder.extra.get("privacy"))   # a DP run: its noise against the update
        if dead:
            outcome = {**outcome, "status": "failed", "error": dead}
    recorder.extra.update(outcome)
    recorder.extra["strategy-history"] = strategy.history
    recorder.extra["failures"] = [{"round": h["round"], **f} for h in strategy.history for f in h.get("failures", [])]
    recorder.extra["rejected"] = [{"round": h["round"], **r} for h in strategy.history for r in h.get("rejected", [])]
    recorder.extra["skipped-rounds"] = [h["round"] for h in strategy.history if h.get("skipped")]
    recorder.write()
    # the last global model (Result.arrays stays empty when every round was skipped)
    recorder.save_model(last_arrays.to_torch_state_dict())
    for r, tier in strategy.narrower_tier_models(cfg.num_server_rounds + 2).items():   # width tiers: each beside it
        recorder.save_model(tier.state_dict(), f"tier-{tier_name(r)}_model.pt")
    recorder.plot(f"{cfg.strategy} · {cfg.dataset}/{cfg.model} · {cfg.partitioning} · {cfg.num_clients} clients · "
                  f"{rounds_text(cfg.num_server_rounds, head_round_row(recorder.rows) is not None)}"
                  + (f" · {privacy_text(recorder.extra['privacy'])}" if recorder.extra.get("privacy") else ""))
    if crash is not None:
        log(ERROR, "fedfuse: run failed: %s; results written to %s", outcome["error"], out)
        raise crash
    if outcome["fallbacks"]:
        log(WARNING, "fedfuse: fusion fell back in %d of %d rounds: %s", outcome["fallbacks"],
            len(strategy.history), outcome["fallback-rounds"])
    if outcome["status"] == "failed":
        log(ERROR, "fedfuse: run failed: %s; results written to %s", outcome["error"], out)
        raise RuntimeError(f"fedfuse: {outcome['error']}")
    (out / "DONE").write_text("ok\n")
    log(INFO, "fedfuse: results written to %s", out)


def head_round(cfg: RunConfig, grid: Grid, strategy: RoundProtocol, evaluation: RoundEvaluation,
               num_classes: int, account: PrivacyAccount | None = None) -> None:
    """The round after the last of a ``head-round=true`` run: the strategy's ``HeadRoundStep``
    (``fedfuse.flower.head.head_step``: what it solves is the strategy's ``head_plan``), recorded (``post-step``) and
    evaluated as round ``num-server-rounds + 1`` (in one-shot mode: progressive fusion with K = 2). Not run when the
    training rounds failed (the run reports that failure)."""
    if fusion_outcome(strategy.history)["status"] != "completed" or not strategy.history:
        log(WARNING, "fedfuse: no head round: the training rounds produced no global model of their own")
        return
    model = strategy.build_model(evaluation.last_arrays.to_torch_state_dict())
    inputs = strategy.fusion_inputs if strategy.fusion_inputs is not None else evaluation.test_x
    # bounded statistics (fedfuse.privacy), noised under DP; DP: the temperature from the released model itself
    privacy = head_privacy(cfg, account, model, inputs) if account is not None or cfg.secure_aggregation else None
    reference = ensemble_reference(strategy, model, inputs, private=account is not None)
    head_rnd = cfg.num_server_rounds + 1
    step = HeadRoundStep(HeadRoundOptions(cfg.head_ridge, cfg.head_solver, cfg.round_timeout, cfg.secure_aggregation),
                         privacy)
    model, record = step(grid, strategy, model, num_classes, head_rnd, reference, one_shot=cfg.mode == "one-shot")
    strategy.history.append({"round": head_rnd, "post-step": "head-round", "valid": record["valid"],
                             "rejected": record["rejected"], "failures": [], "fallback": record["fallback"],
                             "skipped": None, "guard": None, "fusion-seconds": record["seconds"],
                             "fusion-info": {"head-round": record}})
    if evaluation.federated is not None:   # the clients' scores of the kept model are this round's federated evaluation
        evaluation.federated.pending = dict(record.get("federated") or {"federated-clients": 0})
    # the last round's clients stay the reference columns of this row; the one-shot references are not redone
    references, evaluation.references = evaluation.references, "none"
    try:
        evaluation(head_rnd - evaluation.done, ArrayRecord(model.state_dict()))
    finally:
        evaluation.references = references
    head_round_loss_check(evaluation.recorder.rows, head_rnd, record)


def head_round_loss_check(rows: list[dict], head_rnd: int, record: dict) -> None:
    """Loss and accuracy before and after the head round, on the server's test set (central evaluation) or the
    clients' validation splits (federated), into the round's record (``"loss-check"``); a loss that rose is a
    WARNING naming both, even when the accuracy rose: a solved head can raise the accuracy and the loss together
    (the case: docs/trust.md, "What the server bounds", head round)."""
    by_round = {r.get("round"): r for r in rows}
    before, after = by_round.get(head_rnd - 1), by_round.get(head_rnd)
    if before is None or after is None:
        return
    for kind in ("test", "federated"):
        lb, la = before.get(f"{kind}-loss"), after.get(f"{kind}-loss")
        ab, aa = before.get(f"{kind}-accuracy"), after.get(f"{kind}-accuracy")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lb, la, ab, aa)):
            continue
        check = {"loss-before": lb, "loss-after": la, "accuracy-before": ab, "accuracy-after": aa}
        record.setdefault("loss-check", {})[kind] = check
        if la > lb:
            where = "test" if kind == "test" else "federated (clients' validation)"
            log(WARNING, "fedfuse head round: the %s loss rose from %.4f to %.4f (accuracy %.4f -> %.4f)%s", where,
                lb, la, ab, aa, "; the clients scored the model before it higher and it was kept"
                if record.get("kept") == "before" else "")


def run_server(grid: Grid, context: Context, *, wrap_strategy: StrategyWrapper | None = None) -> None:
    """The ServerApp's body: validate the config, build data and strategy, run the rounds, write results.

    ``wrap_strategy(strategy, context)`` may return a strategy wrapping fedfuse's (it is the one
    ``start``-ed; history and results still come from the wrapped fedfuse strategy).

    The run folder is this run's while it runs (``fedfuse.run_control.app_run_folder``: the runner's lock, or the
    ServerApp's own under a plain ``flwr run``): another run writing there is refused before any client trains.
    """
    with ExitStack() as held:
        _serve(grid, context, wrap_strategy, held)


def _serve(grid: Grid, context: Context, wrap_strategy: StrategyWrapper | None, held: ExitStack) -> None:
    """``run_server``'s body; ``held`` keeps the run folder until it returns."""
    limit_threads(int(os.environ.get("FEDFUSE_SERVER_THREADS", "1")))
    notes: list[str] = []
    cfg, account = private_config(check_run_config(context, notes))   # a DP run: its config and (epsilon, delta) account
    out = output_dir(cfg)
    try:   # the folder is this run's: another run writing there is refused before any client trains
        held.enter_context(app_run_folder(out, on_note=lambda text: log(WARNING, text)))
    except RunFolderBusy as exc:
        raise ConfigError(str(exc)) from None
    data, model_fn, strategy = setup(cfg)
    test = getattr(data, "test", None)
    guard_broadcast(strategy, strategy.fusion_inputs if strategy.fusion_inputs is not None
                    else getattr(test, "x", None), device=resolve_device(cfg.device))
    runner = compose_runner(cfg, strategy, account, wrap_strategy, context)
    resumed = _resume_state(cfg, out)
    done = resumed[0] if resumed else 0
    strategy.round_offset = done
    recorder = RunRecorder(out, {**cfg.to_dict(), "num-classes": data.num_classes,
                                 "input-shape": list(data.input_shape), "fusion-set-samples": len(strategy.fusion_inputs)
                                 if strategy.fusion_inputs is not None else 0})
    if notes:
        recorder.extra["config-notes"] = notes
    recorder.extra["server-data"] = server_data_digest(strategy.fusion_inputs, strategy.fusion_labels, test)
    if resumed:
        check_server_data(resumed[1].get("server-data"), recorder.extra["server-data"], out, cfg)
    plan = make_plan(cfg)   # the choices made for the user (fedfuse.plan): recorded, and said once
    recorder.extra["plan"] = plan.to_json()
    for decision in plan.decisions:
        log(INFO, "fedfuse plan: %s", decision.line())
    log(INFO, "fedfuse: %s on %s/%s, %d clients (%s), results in %s", cfg.strategy, cfg.dataset, cfg.model,
        cfg.num_clients, cfg.partitioning, out)
    if cfg.head_round and account is None:   # the head round's temperature reads the last round's client models
        strategy.keep_updates = True
    if cfg.mode == "warm-start":   # round 1 combines the clients' own models (fedfuse.flower.aggregators.warm_start)
        strategy.warm_start = warm_start(cfg, strategy, out)
    initial = (load_initial_model(cfg.initial_model_path, model_fn()) if cfg.initial_model_path
               else model_fn().state_dict())
    if resumed:
        _, run_state, initial = resumed
        recorder.rows = list(run_state.get("rows", []))
        strategy.history = list(run_state.get("strategy-history", []))
        recorder.extra["resumed-from-rounds"] = list(run_state.get("resumed-from-rounds", [])) + [done]
        log(INFO, "fedfuse: resuming %s after round %d of %d", out, done, cfg.num_server_rounds)
    evaluation = RoundEvaluation(cfg, data, model_fn, strategy, recorder, out, done, initial)
    if not evaluation.central:
        log(INFO, "fedfuse: evaluation='federated': the clients evaluate the global model on their validation "
            "splits every round; the server holds no test set")
    train_config = ConfigRecord({"mode": cfg.mode, "local-epochs": cfg.local_epochs, "lr": cfg.lr})
    crash: BaseException | None = None
    try:
        if cfg.num_server_rounds > done:
            runner.start(grid=grid, initial_arrays=evaluation.last_arrays, num_rounds=cfg.num_server_rounds - done,
                         timeout=cfg.round_timeout, train_config=train_config, evaluate_fn=evaluation)
        if cfg.head_round and done <= cfg.num_server_rounds:
            head_round(cfg, grid, strategy, evaluation, data.num_classes, account)
    except Exception as exc:  # noqa: BLE001 - recorded as the run's error, then re-raised by _write_results
        crash = exc
    if account is not None:
        recorder.extra["privacy"] = {**account.summary(), "rounds": runner.history}
        log(INFO, "fedfuse dp: (epsilon, delta) = (%.3f, %g) after %d releases", account.epsilon, account.delta,
            len(account.releases))
    _write_results(cfg, out, strategy, recorder, evaluation.last_arrays, crash)


def make_server_app(*, wrap_strategy: StrategyWrapper | None = None) -> ServerApp:
    """fedfuse's ServerApp; ``wrap_strategy(strategy, context)`` may wrap the strategy (see ``run_server``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, context, wrap_strategy=wrap_strategy)

    return server_app


app = make_server_app()
