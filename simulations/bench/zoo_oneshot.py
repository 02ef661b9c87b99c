"""One-shot Fashion-MNIST with the models users bring: 5 clients, Dirichlet α = 0.3, every alignment and
averaging method of ``fedfuse.fusion`` on three models fedfuse has no adapter of its own for.

The models (``MODELS``), each written the way a user writes it, not built from fedfuse's families:

- ``net``: Flower's quickstart-pytorch ``Net`` (conv 6 @ 5x5 → pool → conv 16 @ 5x5 → pool → ``view`` → fc 120 →
  fc 84 → fc 10, ``F.relu``), with 1 input channel and ``fc1`` on 16·4·4 features for 1x28x28 images.
- ``rescnn``: a residual CNN with hand-written skips: stem conv 1→32 + BN + relu (then a 2x2 max-pool: the
  ResNet-style stem that keeps a 1-core client epoch short), block ``x = F.relu(x + block(x))`` (block =
  conv-BN-relu-conv-BN at 32 channels), a strided conv 32→64 + BN + relu, the same block at 64 channels, global
  average pool, Linear 64→10.
- ``mobilenet``: torchvision's ``mobilenet_v2(width_mult=0.25, num_classes=10)``, its first conv given 1 input
  channel and the 28x28 images upsampled (bilinear, parameter-free) to 32x32, as ``fedfuse.models.zoo`` fits a zoo
  model to the dataset (``build_model('torchvision:mobilenet_v2')`` has no ``width_mult``: at width 1 a 1-core
  client epoch is too slow for this bench).

Clients: the split is ``fmnist_splits``' NIID-Bench Dirichlet split (the 1,000-image public pool held out), as in
``fmnist_oneshot``; each client an independently initialised model (seed ``1000·seed + client + 1``) trained on
90 % of its data (10 % held out: its validation split, which the head round's choice reads) with SGD lr 0.01,
momentum 0.9, weight decay 1e-5, batch 64, ``--epochs`` local epochs. Inputs are normalised by the Fashion-MNIST
training set's mean and std (0.2860, 0.3530), the clients', the fusion set's and the test set's alike. Trained
clients are cached under ``--cache`` (``results/cache/``, git-ignored).

Rows: each client, best and mean client, the ensemble (``fedfuse.references.client_rows``), and every method of
``--methods`` (``fedfuse.fusion.fuse_result`` with the fusion set = the public pool, weights = sample counts,
default options), each without the head round (one exchange) and with it (``fmnist_oneshot.head_round``: ridge and
LDA heads from the clients' statistics, kept by the clients' validation score, as ``head-solver='best'``). A method
that raises is a row ``refused: <exception>: <message>`` (a ``FusionError``: the method declined the models) or
``failed: ...`` (any other exception: a bug); a method that takes at most 2 models (``hf-linear``,
``hf-gradient``) is a row ``skipped`` here (5 clients). Nothing is dropped.

Cost: ``fuse-seconds`` and ``floor-seconds``, the seconds of one forward pass of every client over the fusion set
(the *physical floor*: what any data-reading fusion has to spend at least), measured in the same process; the table
shows their ratio only (the machine is shared, so the seconds themselves mean little). Most of a run's time is the
fusion calls and the head rounds (one pass of each fused model over every client's training data), not the local
training: on one core the 3-seed run of the defaults takes about 2 core-hours, ``--quick`` about 40 core-minutes.
Each row records ``code``, the commit (and a hash of fedfuse/'s uncommitted diff) it was computed with.

    .venv/bin/python -m simulations.bench.zoo_oneshot --quick                  # 1 seed, 2 epochs: a smoke run
    .venv/bin/python -m simulations.bench.zoo_oneshot                          # 3 seeds -> results/zoo-oneshot/
    .venv/bin/python -m simulations.bench.zoo_oneshot --table-only             # the table from the per-seed JSON
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.data.partition import split_train_val  # noqa: E402
from fedfuse.fusion import METHOD_SPECS, fuse_result  # noqa: E402
from fedfuse.fusion.registry import FusionError  # noqa: E402
from fedfuse.references import client_rows  # noqa: E402
from fedfuse.training import predict_logits, train  # noqa: E402
from simulations.bench.fmnist_oneshot import PUBLIC, REF_METHODS, SPLITS, acc, head_round  # noqa: E402
from simulations.bench.fmnist_splits import write_splits  # noqa: E402

CLIENTS = 5
PART = "dir0.3"
MEAN, STD = 0.2860, 0.3530   # Fashion-MNIST's 60,000 training images
METHODS = "average,kd,feddf,ot,rebasin,transfusion,kf-linear,hf-linear,kf-gradient,hf-gradient,fs-merge"
# rescnn / mobilenet: 2 local epochs keep a 3-seed run near 2 core-hours on a 1-core client (the fusion calls and
# the head rounds' passes over the clients' data, not the training, are most of it: see the module docstring)
EPOCHS = "net=10,rescnn=2,mobilenet=2"


# ------------------------------------------------------------------------------------------- the models
class Net(nn.Module):
    """Flower's quickstart-pytorch ``Net`` (its ``task.py``), for ``channels`` x ``side`` x ``side`` images
    (the quickstart's own: 3 x 32 x 32; Fashion-MNIST: 1 x 28 x 28)."""

    def __init__(self, channels: int = 3, side: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        s = ((side - 4) // 2 - 4) // 2   # the side after conv 5x5, pool, conv 5x5, pool: 5 at 32, 4 at 28
        self.flat = 16 * s * s
        self.conv1 = nn.Conv2d(channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(self.flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, self.flat)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _block(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))


class ResidualCNN(nn.Module):
    """A residual CNN as a user writes it: hand-written skips ``x = F.relu(x + block(x))`` and BatchNorm."""

    def __init__(self, channels: int = 1, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.block1 = _block(width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.down_bn = nn.BatchNorm2d(2 * width)
        self.block2 = _block(2 * width)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem_bn(self.stem(x))), 2)
        x = F.relu(x + self.block1(x))
        x = F.relu(self.down_bn(self.down(x)))
        x = F.relu(x + self.block2(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def mobilenet(channels: int = 1, side: int = 28, num_classes: int = 10) -> nn.Module:
    """torchvision ``mobilenet_v2(width_mult=0.25)`` fitted to the images as ``fedfuse.models.zoo`` fits a zoo
    model: the first conv takes ``channels`` (the builder's own initialisation of its first input channels), inputs
    below 32 pixels upsampled to 32x32 by a parameter-free ``Resized``."""
    import torchvision

    from fedfuse.models.zoo import Resized, _set_in_channels, _upsampled

    model = torchvision.models.mobilenet_v2(weights=None, width_mult=0.25, num_classes=num_classes)
    _set_in_channels(model, channels, "torchvision:mobilenet_v2(width_mult=0.25)")
    size = _upsampled(side, side)
    return model if size == (side, side) else Resized(model, size)


MODELS = {"net": lambda: Net(1, 28), "rescnn": lambda: ResidualCNN(1), "mobilenet": lambda: mobilenet(1, 28)}
LABELS = {"net": "Flower quickstart Net (1x28x28)", "rescnn": "residual CNN (hand-written skips, BatchNorm)",
          "mobilenet": "torchvision mobilenet_v2, width 0.25 (1 channel, upsampled to 32x32)"}


def code_state() -> str:
    """``<HEAD commit>[+<sha1 of the uncommitted diff of fedfuse/>]``: which fedfuse code the rows come from
    (read-only git calls; another engineer may be editing fedfuse while a bench runs)."""
    import hashlib
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout

    head, diff = git("rev-parse", "--short", "HEAD").strip(), git("diff", "HEAD", "--", "fedfuse")
    return head + (f"+{hashlib.sha1(diff.encode()).hexdigest()[:10]}" if diff else "")


CODE = code_state()


def build(name: str, init_seed: int) -> nn.Module:
    torch.manual_seed(init_seed)
    return MODELS[name]()


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - MEAN) / STD


# ------------------------------------------------------------------------------------------- clients
def clients_of(name: str, folder: Path, seed: int, epochs: int, cache: Path) -> list[dict]:
    """Train (or load) the cell's clients: model, train / val split, seconds of one local epoch."""
    out = []
    for pid in range(CLIENTS):
        with np.load(folder / f"node-{pid}.npz") as z:
            x, y = normalise(torch.from_numpy(z["x_train"])), torch.from_numpy(z["y_train"])
        tr, va = split_train_val(np.arange(len(y)), y.numpy(), 0.1, seed)
        tr, va = torch.as_tensor(tr), torch.as_tensor(va)
        model = build(name, seed * 1000 + pid + 1)
        path = cache / name / f"{folder.name}-e{epochs}" / f"client{pid}.pt"
        if path.exists():
            rec = torch.load(path, weights_only=False)
            model.load_state_dict(rec["state"])
        else:
            info = train(model, x[tr], y[tr], epochs=epochs, batch_size=64, optimizer="sgd", lr=0.01, momentum=0.9,
                         weight_decay=1e-5, seed=seed * 1000 + pid)
            rec = {"state": model.state_dict(), "seconds": info["train-seconds"]}
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rec, path)
            print(f"  {name} client {pid}: trained {epochs} epochs in {rec['seconds']:.0f}s", flush=True)
        model.eval()
        out.append({"model": model, "x": x[tr], "y": y[tr], "vx": x[va], "vy": y[va],
                    "epoch-seconds": rec["seconds"] / epochs, "n": len(tr)})
    return out


def floor_seconds(models: list[nn.Module], fx: torch.Tensor, repeats: int = 3) -> float:
    """Seconds of one forward pass of every model over the fusion set (the median of ``repeats``)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in models:
            predict_logits(m, fx)
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


def run_cell(name: str, folder: Path, seed: int, epochs: int, methods: list[str], cache: Path) -> list[dict]:
    clients = clients_of(name, folder, seed, epochs, cache)
    with np.load(folder / "test.npz") as z:
        tx, ty = normalise(torch.from_numpy(z["x"])), torch.from_numpy(z["y"])
    with np.load(SPLITS / f"fmnist-public{PUBLIC}.npz") as z:
        fx = normalise(torch.from_numpy(z["x"]))
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    floor = floor_seconds(models, fx)
    base = {"model": name, "code": CODE, "part": PART, "seed": seed, "epochs": epochs, "fusion-size": len(fx),
            "epoch-seconds": float(np.mean([c["epoch-seconds"] for c in clients])), "floor-seconds": floor,
            "parameters": sum(p.numel() for p in models[0].parameters())}
    accs, refs = client_rows([predict_logits(m, tx) for m in models], range(len(models)), n, ty)
    rows = [{**base, "method": f"client-{p}", "accuracy": a} for p, a in accs.items()]
    rows += [{**base, "method": REF_METHODS[r["key"]], "accuracy": r["accuracy"]} for r in refs
             if r["key"] in REF_METHODS]
    print(f"  {name} seed {seed}: best client {rows[CLIENTS]['accuracy']:.4f}, ensemble "
          f"{rows[CLIENTS + 2]['accuracy']:.4f}; floor {floor:.3f}s", flush=True)
    for method in methods:
        spec = METHOD_SPECS.get(method)
        if spec is not None and spec.max_models is not None and spec.max_models < len(models):
            rows.append({**base, "method": method, "accuracy": None, "with-head": None,
                         "status": f"skipped: takes at most {spec.max_models} models, this cell has {len(models)}"})
            print(f"  {name} {method:<12} skipped (at most {spec.max_models} models)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            res = fuse_result(method, models, fusion_inputs=fx, weights=n, seed=seed)
        except FusionError as exc:
            rows.append({**base, "method": method, "accuracy": None, "with-head": None,
                         "status": f"refused: {_reason(exc)}", "fuse-seconds": time.perf_counter() - t0})
            print(f"  {name} {method:<12} refused: {_reason(exc)}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - a bug in the method: recorded with its traceback, never dropped
            rows.append({**base, "method": method, "accuracy": None, "with-head": None,
                         "status": f"failed: {_reason(exc)}", "traceback": traceback.format_exc(limit=-4),
                         "fuse-seconds": time.perf_counter() - t0})
            print(f"  {name} {method:<12} FAILED: {_reason(exc)}", flush=True)
            continue
        secs = time.perf_counter() - t0
        fused = res.model
        row = {**base, "method": method, "fuse-seconds": secs, "fuse-per-floor": secs / floor,
               "fuse-per-epoch": secs / base["epoch-seconds"], "status": "ok"}
        row["accuracy"] = acc(predict_logits(fused, tx), ty)
        try:
            headed, info = head_round(fused, clients)
            row["with-head"], row["head"] = acc(predict_logits(headed, tx), ty), info
        except Exception as exc:  # noqa: BLE001 - recorded
            row["with-head"], row["status"] = None, f"head round failed: {_reason(exc)}"
        rows.append(row)
        wh = f"{row['with-head']:.4f} ({row['head']['solver']})" if row["with-head"] is not None else row["status"]
        print(f"  {name} {method:<12} {row['accuracy']:.4f} -> head {wh}  {secs:.1f}s = {secs / floor:.1f} floors",
              flush=True)
    return rows


# ------------------------------------------------------------------------------------------- the table
ROW_NAMES = {"average": "one-shot FedAvg (`average`)", "kd": "KD (`kd`, ensemble into client 0's model)",
             "feddf": "FedDF (`feddf`)"}


def _ms(values: list[float]) -> str:
    v = [100 * x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return ""
    if len(v) == 1:
        return f"{v[0]:.1f} (n=1)"
    return f"{statistics.mean(v):.1f} ± {statistics.stdev(v):.1f} (n={len(v)})"


def _ratio(values: list[float]) -> str:
    v = [x for x in values if x is not None]
    return f"{statistics.mean(v):.1f}" if v else ""


def write_table(out: Path) -> str:
    rows = []
    for f in sorted(out.glob("seed*.json")):
        rows += json.loads(f.read_text())
    if not rows:
        return ""
    lines = ["# One-shot Fashion-MNIST with models users bring", "",
             f"5 clients, NIID-Bench Dirichlet α = 0.3, fusion set: the 1,000-image public pool; test accuracy in %, "
             "mean ± sample std (ddof=1) over seeds. `+ head round`: the second exchange (ridge / LDA head from the "
             "clients' statistics, `head-solver='best'`). `÷ floor`: fusion seconds ÷ the seconds of one forward "
             "pass of every client over the fusion set, measured in the same process (mean over seeds). Written by "
             "`simulations/bench/zoo_oneshot.py`.", ""]
    for name in MODELS:
        mrows = [r for r in rows if r["model"] == name]
        if not mrows:
            continue
        seeds = sorted({r["seed"] for r in mrows})
        ep = sorted({r["epochs"] for r in mrows})
        lines += [f"## {LABELS[name]}", "",
                  f"{mrows[0]['parameters']:,} parameters; {', '.join(map(str, ep))} local epochs; seeds "
                  f"{', '.join(map(str, seeds))}", "",
                  "| row | one exchange | + head round | fusion s ÷ floor | status |", "|---|---|---|---|---|"]
        order = [f"client-{i}" for i in range(CLIENTS)] + list(REF_METHODS.values())
        order += [m for m in dict.fromkeys(r["method"] for r in mrows) if m not in order]
        for method in order:
            rs = [r for r in mrows if r["method"] == method]
            if not rs:
                continue
            status = sorted({r.get("status", "ok") for r in rs})
            note = "; ".join(s for s in status if s != "ok")
            if len(status) > 1 and "ok" in status:
                note = f"{sum(r.get('status', 'ok') == 'ok' for r in rs)}/{len(rs)} ok; " + note
            lines.append(f"| {ROW_NAMES.get(method, method)} | {_ms([r['accuracy'] for r in rs])} | "
                         f"{_ms([r.get('with-head') for r in rs])} | {_ratio([r.get('fuse-per-floor') for r in rs])} "
                         f"| {note.replace('|', '/')} |")
        lines.append("")
    text = "\n".join(lines)
    (out / "table.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", default=EPOCHS, help="one number for every model, or model=epochs,...")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--quick", action="store_true", help="smoke mode: seed 0, 2 epochs, out results/zoo-oneshot-quick")
    ap.add_argument("--cache", default="results/cache/zoo-oneshot")
    ap.add_argument("--out", default=None, help="default results/zoo-oneshot (--quick: results/zoo-oneshot-quick)")
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out or ("results/zoo-oneshot-quick" if a.quick else "results/zoo-oneshot"))
    out.mkdir(parents=True, exist_ok=True)
    if a.table_only:
        print(write_table(out))
        return
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",")]
    names = a.models.split(",")
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if a.quick:
        epochs = {m: 2 for m in names}
    elif "=" in a.epochs:
        epochs = {k: int(v) for k, v in (kv.split("=") for kv in a.epochs.split(","))}
    else:
        epochs = {m: int(a.epochs) for m in names}
    methods = a.methods.split(",")
    t_all = time.perf_counter()
    for folder in write_splits(SPLITS, [PART], CLIENTS, seeds, PUBLIC):
        seed = json.loads((folder / "split.json").read_text())["seed"]
        path = out / f"seed{seed}.json"
        kept = [r for r in json.loads(path.read_text()) if r["model"] not in names] if path.exists() else []
        rows = []
        for name in names:
            t0 = time.perf_counter()
            rows += run_cell(name, folder, seed, epochs[name], methods, Path(a.cache))
            print(f"{name} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
            path.write_text(json.dumps(kept + rows, separators=(",", ":")) + "\n")   # compact, as results_index stores it
    print(write_table(out))
    print(f"zoo_oneshot: {time.perf_counter() - t_all:.0f}s in all", flush=True)


if __name__ == "__main__":
    main()
