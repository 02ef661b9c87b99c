"""Client training and the cache of trained clients: the one place benchmarks get client models from.

``Recipe`` is a training recipe; ``train_client`` is the one trainer every benchmark uses (the
one-shot clients, the OT/transport bases, the ToFu models and the ToFu FedAvg clients). With
``optimizer="adam"``, no weight decay, no label smoothing, ``schedule="constant"`` and ``patience=0`` it
is step for step ``fedfuse.training.train`` (the FL client's trainer).

``CellConfig`` holds everything that determines the trained clients of one (dataset, partition, model,
seed) cell; ``get_clients`` trains them once, caches them under ``<cache>/<CellConfig.key()>/`` and adds
importance scores computed by each client on its own validation split (as the fedfuse ClientApp does).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.data import FederatedData
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.training import make_optimizer, resolve_device

from simulations.bench.specs import parse_partition
from fedfuse.flower.runner.console import progress

CACHE_VERSION = 2  # bump when a change to training makes cached clients stale

SCHEDULES = ("cosine", "constant", "onecycle")


@dataclass(frozen=True)
class Recipe:
    """A client training recipe.

    ``schedule``: ``cosine`` (annealing over ``epochs``, stepped per epoch), ``constant``, or ``onecycle``
    (``OneCycleLR`` with 10 % warm-up, stepped per batch). ``patience`` > 0: early stopping on the
    validation cross-entropy, the best epoch's weights kept; 0 trains all ``epochs``.
    """

    epochs: int
    lr: float
    optimizer: str = "adamw"
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    patience: int = 10
    schedule: str = "cosine"
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"recipe schedule: {self.schedule!r} is not one of {SCHEDULES}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"recipe: epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")


def plain_recipe(epochs: int, lr: float, batch_size: int = 32) -> Recipe:
    """Adam, constant lr, no regularisation, no early stopping: ``fedfuse.training.train``'s recipe."""
    return Recipe(epochs=epochs, lr=lr, optimizer="adam", weight_decay=0.0, label_smoothing=0.0, patience=0,
                  schedule="constant", batch_size=batch_size)


# The one-shot recipe (the paper's base-model training scaled down): AdamW, batch 32, label smoothing 0.1,
# cosine annealing over ``epochs`` (a maximum), early stopping on the client's validation split (patience
# 10). ``epochs``/``lr`` per (dataset, model) were chosen on the clients' validation splits, never on test.
RECIPE_DEFAULTS: dict[str, Any] = dict(optimizer="adamw", weight_decay=1e-4, label_smoothing=0.1, patience=10,
                                       schedule="cosine")
TRAIN_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("digits", "mlp"): dict(epochs=60, lr=3e-3),
    ("mnist1d", "mlp"): dict(epochs=60, lr=3e-3),
    ("digits", "cnn"): dict(epochs=30, lr=3e-3),
    ("mnist1d", "cnn"): dict(epochs=30, lr=3e-3),
    ("digits", "vit"): dict(epochs=40, lr=1e-3),
    ("mnist1d", "vit"): dict(epochs=40, lr=1e-3),
}
FALLBACK_TRAIN = dict(epochs=30, lr=1e-3)
WIDTH_DEFAULTS = {"mlp": 128, "cnn": 16, "resnet": 16, "vit": 32}
DEPTH_DEFAULTS = {"mlp": 2, "cnn": 2, "resnet": 2, "vit": 2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_client(model: nn.Module, x: torch.Tensor, y: torch.Tensor, recipe: Recipe, seed: int,
                 val: tuple[torch.Tensor, torch.Tensor] | None = None, device: str | torch.device = "cpu"
                 ) -> dict[str, Any]:
    """Train ``model`` in place on ``x`` ``[N, *input_shape]`` / ``y`` ``[N]`` with ``recipe``.

    ``seed`` seeds the batch order. With ``recipe.patience`` > 0 and a non-empty ``val`` the model is left
    at the weights of the epoch with the lowest validation cross-entropy. Returns ``train-seconds``,
    ``train-loss`` (last epoch), ``epochs`` run, ``best-epoch``, ``val-loss`` and ``val-accuracy``
    (NaN without early stopping).
    """
    device = resolve_device(device)
    model.to(device).train()
    opt = make_optimizer(model.parameters(), recipe.optimizer, recipe.lr, recipe.weight_decay)
    n = len(x)
    steps_per_epoch = (n + recipe.batch_size - 1) // recipe.batch_size
    epoch_sched = batch_sched = None
    if recipe.schedule == "cosine":
        epoch_sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, recipe.epochs))
    elif recipe.schedule == "onecycle":
        batch_sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, pct_start=0.1,
                                                          total_steps=recipe.epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    early_stopping = recipe.patience > 0 and val is not None and len(val[0]) > 0

    def val_metrics() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            lg = torch.cat([model(val[0][i:i + 512].to(device)).float().cpu() for i in range(0, len(val[0]), 512)])
        model.train()
        return F.cross_entropy(lg, val[1]).item(), (lg.argmax(1) == val[1]).float().mean().item()

    _sync(device)
    t0 = time.perf_counter()
    best = (float("inf"), float("nan"), 0)
    best_state = None
    bad, last, ep = 0, float("nan"), 0
    for ep in range(1, recipe.epochs + 1):
        perm = torch.randperm(n, generator=gen)
        total, count = 0.0, 0
        for start in range(0, n, recipe.batch_size):
            idx = perm[start:start + recipe.batch_size]
            if len(idx) < 2 and n >= 2:  # BatchNorm cannot train on a single sample
                continue
            xb, yb = x[idx].to(device), y[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb, label_smoothing=recipe.label_smoothing)
            loss.backward()
            opt.step()
            if batch_sched is not None:
                batch_sched.step()
            total += loss.item() * len(idx)
            count += len(idx)
        last = total / max(count, 1)
        if epoch_sched is not None:
            epoch_sched.step()
        if not early_stopping:
            continue
        vl, vacc = val_metrics()
        if vl != vl:  # NaN validation loss: keep training, keep the last weights
            best, best_state = (vl, vacc, ep), None
            continue
        if vl < best[0] - 1e-6:
            best, bad = (vl, vacc, ep), 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            bad += 1
            if bad >= recipe.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    _sync(device)
    seconds = time.perf_counter() - t0
    model.eval()
    return {"train-seconds": seconds, "train-loss": last, "epochs": ep,
            "best-epoch": best[2] if early_stopping else ep, "val-loss": best[0] if early_stopping else float("nan"),
            "val-accuracy": best[1]}


@dataclass
class CellConfig:
    """Everything that determines the trained clients of one cell; hashed into the cache key (field names
    and CACHE_VERSION are part of the key: keep them stable)."""

    dataset: str
    partition: str
    model: str
    seed: int
    width: int
    depth: int
    epochs: int
    lr: float
    batch_size: int = 32
    val_fraction: float = 0.1
    alpha: float = 0.5
    fusion_source: str = "client0"
    importance_samples: int = 256
    model_options: dict = field(default_factory=dict)
    optimizer: str = RECIPE_DEFAULTS["optimizer"]
    weight_decay: float = RECIPE_DEFAULTS["weight_decay"]
    label_smoothing: float = RECIPE_DEFAULTS["label_smoothing"]
    patience: int = RECIPE_DEFAULTS["patience"]      # 0 = no early stopping (train all epochs)
    schedule: str = RECIPE_DEFAULTS["schedule"]

    def __post_init__(self) -> None:
        parse_partition(self.partition)
        self.recipe()  # validates the recipe fields

    def recipe(self) -> Recipe:
        return Recipe(epochs=self.epochs, lr=self.lr, optimizer=self.optimizer, weight_decay=self.weight_decay,
                      label_smoothing=self.label_smoothing, patience=self.patience, schedule=self.schedule,
                      batch_size=self.batch_size)

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "v": CACHE_VERSION}, sort_keys=True)
        return (f"{self.dataset}-{self.partition}-{self.model}-s{self.seed}-"
                + hashlib.sha1(blob.encode()).hexdigest()[:10])


def cell_config(dataset: str, partition: str, model: str, seed: int, **overrides: Any) -> CellConfig:
    """A ``CellConfig`` with the per-(dataset, model) defaults; ``overrides`` with value ``None`` or 0 for
    width/depth/epochs/lr keep the default (the CLIs' "0 = default")."""
    d = TRAIN_DEFAULTS.get((dataset, model), FALLBACK_TRAIN)
    base = dict(width=WIDTH_DEFAULTS.get(model, 64), depth=DEPTH_DEFAULTS.get(model, 2), epochs=d["epochs"],
                lr=d["lr"])
    known = {f.name for f in fields(CellConfig)}
    for k, v in overrides.items():
        if k not in known:
            raise ValueError(f"cell_config: unknown setting {k!r}; valid: {sorted(known)}")
        if v is None or (k in base and not v):
            continue
        base[k] = v
    return CellConfig(dataset=dataset, partition=partition, model=model, seed=seed, **base)


RECIPE_ARGS = ("width", "depth", "epochs", "lr", "batch_size", "optimizer", "weight_decay", "label_smoothing",
               "patience", "schedule", "val_fraction", "importance_samples", "alpha", "fusion_source")


def add_client_arguments(ap) -> None:
    """The client-setting flags every benchmark on cached clients takes (all hashed into the cache key)."""
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    ap.add_argument("--fusion-source", default="client0", choices=["client0", "public"])
    ap.add_argument("--width", type=int, default=0, help="model width (0 = default: mlp 128, cnn 16, vit 32)")
    ap.add_argument("--depth", type=int, default=0, help="model depth (0 = per-model default)")
    ap.add_argument("--epochs", type=int, default=0, help="client epochs, a maximum (0 = per dataset/model default)")
    ap.add_argument("--lr", type=float, default=0.0, help="client learning rate (0 = default)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--optimizer", default=RECIPE_DEFAULTS["optimizer"], choices=["adam", "adamw", "sgd"])
    ap.add_argument("--weight-decay", type=float, default=RECIPE_DEFAULTS["weight_decay"])
    ap.add_argument("--label-smoothing", type=float, default=RECIPE_DEFAULTS["label_smoothing"])
    ap.add_argument("--patience", type=int, default=RECIPE_DEFAULTS["patience"],
                    help="client early stopping on its validation loss (0 = off, train all --epochs)")
    ap.add_argument("--schedule", default=RECIPE_DEFAULTS["schedule"], choices=list(SCHEDULES))
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--importance-samples", type=int, default=256)
    ap.add_argument("--model-options", default="{}", help='JSON per model, e.g. {"vit": {"num_heads": 2}}')
    ap.add_argument("--cache", default="results/cache", help="trained-client cache folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")


def cell_from_args(args, dataset: str, partition: str, model: str, seed: int) -> CellConfig:
    """The ``CellConfig`` of one cell from ``add_client_arguments`` flags."""
    model_options = json.loads(args.model_options) if isinstance(args.model_options, str) else args.model_options
    return cell_config(dataset, partition, model, seed, model_options=model_options.get(model, {}),
                       **{k: getattr(args, k) for k in RECIPE_ARGS})


def load_data(cfg: CellConfig, fusion_size: int, fusion_source: str | None = None) -> FederatedData:
    """The cell's partitioned data with a fusion set of ``fusion_size`` samples."""
    spec = parse_partition(cfg.partition)
    return FederatedData.build(cfg.dataset, spec.num_clients, spec.method, alpha=cfg.alpha, fusion_size=fusion_size,
                               fusion_source=fusion_source or cfg.fusion_source, seed=cfg.seed)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def client_seed(cfg: CellConfig, pid: int) -> int:
    """Initialisation and batch-order seed of client ``pid`` (independently initialised clients)."""
    return cfg.seed * 1000 + pid


def get_clients(cfg: CellConfig, data: FederatedData, importance: list[str], cache_dir: Path,
                device: str = "cpu", log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Train (or load from the cache) every client of a cell; compute missing client-side scores.

    Returns one dict per client: ``model`` (eval mode, CPU), ``train_seconds``, ``train_info``, ``scores``
    ``{method: {level: [width]}}`` (computed on the client's own validation split), ``val`` (its
    validation split), ``val_size``, ``train_size`` and ``class_counts`` (per-class training counts).
    """
    d = Path(cache_dir) / cfg.key()
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(asdict(cfg), indent=1, sort_keys=True))
    recipe = cfg.recipe()
    out = []
    for pid in progress(range(data.num_clients), desc="clients", unit="client", leave=False):  # bar + ETA on a tty
        path = d / f"client{pid}.pt"
        model = build_model(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape, width=cfg.width,
                            depth=cfg.depth, seed=client_seed(cfg, pid), **cfg.model_options)
        tr, va = data.client_data(pid, cfg.val_fraction, cfg.seed)
        rec = torch.load(path, weights_only=False) if path.exists() else None
        if rec is None:
            info = train_client(model, tr.x, tr.y, recipe, seed=client_seed(cfg, pid), val=(va.x, va.y),
                                device=device)
            rec = {"state": {k: v.cpu() for k, v in model.state_dict().items()},
                   "train_seconds": info["train-seconds"], "train_loss": info["train-loss"], "train_info": info,
                   "scores": {}}
            log(f"    client {pid}: trained {len(tr)} samples in {info['train-seconds']:.1f}s "
                f"({info['epochs']} epochs, best {info['best-epoch']}, val loss {info['val-loss']:.3f}, "
                f"val acc {info['val-accuracy']:.3f})")
            _atomic_save(rec, path)
        model.load_state_dict(rec["state"])
        model.cpu().eval()
        changed = False
        for imp in importance:
            if imp not in rec["scores"]:
                k = min(cfg.importance_samples, len(va))
                rec["scores"][imp] = neuron_importance(model, va.x[:k], va.y[:k], method=imp, device=device)
                changed = True
        if changed:
            _atomic_save(rec, path)
        out.append({"model": model, "train_seconds": rec["train_seconds"], "train_info": rec.get("train_info", {}),
                    "scores": rec["scores"], "val": va, "val_size": len(va), "train_size": len(tr),
                    "class_counts": torch.bincount(tr.y, minlength=data.num_classes)[:data.num_classes].tolist()})
    return out
