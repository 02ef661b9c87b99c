"""Token Fusion (ToFu) benchmark: throughput, accuracy and a federated end-to-end run (GitHub issue #7).

Paper: "Token Fusion: Bridging the Gap between Token Pruning and Token Merging" (Kim et al., WACV 2024).
Every number is a ratio to "off" measured in the
same run (timings are interleaved round-robin over the configurations and summarised by the median,
so a noisy shared CPU hits all arms alike).

Parts (``--part``):
  throughput  ViT-Ti-sized timm ViT (192-d, 12 blocks, 224 px / patch 16 → 197 tokens), random input,
              batch 32: images/s for inference and for a training step (forward+backward+SGD).
  accuracy    (a) the project ViT on MNIST-1D (``build_model("vit", (1, 40))``, patch 2 → 21 tokens) and
              (b) a larger proxy ViT on sklearn digits upsampled to 32×32 (patch 4 → 65 tokens,
              8 blocks): train once with ToFu off, then evaluate with every mode × r (ToFu is
              training-free), plus inference throughput on the same model; and (c) a short training
              run *with* ToFu on the proxy (time and accuracy vs training without).
  federated   N clients, FedAvg rounds in plain PyTorch on ``fedfuse.data`` partitions; local training
              with and without ToFu; per-round client training time and final global accuracy.

Modes: ``tofu`` (prune for blocks < depth//2, MLERP after), ``tofu_avg`` (prune, then average),
``tome`` (average everywhere, ToMe-style), ``prune`` (pruning everywhere) and ``off``.

    python -m simulations.bench.tofu --part all
    python -m simulations.bench.tofu --part throughput --quick     # smoke run
Results: ``<out>/<part>.json`` and ``<out>/tofu_benchmark.md`` (all parts found; ``--out`` default
``results/tofu``). Single seed (``--seed``); timings are medians of ``--reps`` interleaved repeats.
Models are trained with the harness trainer (``simulations.bench.clients.train_client``).
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse import tofu
from fedfuse.training import resolve_device

from simulations.bench.clients import Recipe, plain_recipe, train_client
from simulations.bench.timing import interleaved_timings
from fedfuse.flower.runner.console import progress, progress_print

RESULTS = Path("results/tofu")
MODES: dict[str, dict] = {
    "tofu": dict(merge="mlerp"),                       # prune_until = depth // 2 (paper's d = 6 of 12)
    "tofu_avg": dict(merge="average"),
    "tome": dict(merge="average", prune_until=0),
    "prune": dict(merge="prune"),
}


# ------------------------------------------------------------------------------------------- helpers

def _configs(rs: list[int], modes: list[str]) -> list[tuple[str, int]]:
    return [("off", 0)] + [(m, r) for r in rs for m in modes]


def _set(model: nn.Module, mode: str, r: int, proportional_attention: bool = True) -> None:
    """Configure ToFu on ``model`` in place for one benchmark arm."""
    tofu.remove(model)
    if mode != "off" and r > 0:
        tofu.apply(model, r=r, proportional_attention=proportional_attention, **MODES[mode])


def timed_sweep(model: nn.Module, step: Callable[[], None], configs: list[tuple[str, int]], reps: int,
                device: torch.device, warmup: int = 1, proportional_attention: bool = True
                ) -> dict[tuple[str, int], list[float]]:
    """Seconds per call of ``step`` for every config, interleaved: rep 1 of all, rep 2 of all, …"""
    times = interleaved_timings({c: step for c in configs}, reps, warmup=warmup, device=device,
                                before=lambda c: _set(model, *c, proportional_attention=proportional_attention))
    tofu.remove(model)
    return {c: t["wall"] for c, t in times.items()}


def _rows_from_times(times: dict[tuple[str, int], list[float]], batch: int) -> list[dict]:
    off = statistics.median(times[("off", 0)])
    rows = []
    for (mode, r), ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(mode=mode, r=r, seconds_median=med, seconds_all=ts, images_per_s=batch / med,
                         speedup=off / med))
    return rows


# ---------------------------------------------------------------------------------------- throughput

def vit_tiny(num_classes: int = 1000, img_size: int = 224, seed: int = 0) -> nn.Module:
    """ViT-Ti/16 sized timm model (192-d, 12 blocks, 3 heads): 197 tokens at 224 px."""
    from timm.models.vision_transformer import VisionTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VisionTransformer(img_size=img_size, patch_size=16, num_classes=num_classes, embed_dim=192,
                                 depth=12, num_heads=3, mlp_ratio=4.0, qkv_bias=True)


def part_throughput(device: torch.device, rs: list[int], modes: list[str], batch: int, reps: int,
                    train_rs: list[int], train_batch: int, img_size: int = 224) -> dict:
    model = vit_tiny(img_size=img_size).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, img_size, img_size, generator=g).to(device)
    n_tokens = model.patch_embed.num_patches + model.num_prefix_tokens

    model.eval()

    def infer() -> None:
        with torch.inference_mode():
            model(x)

    progress_print(f"[tofu] throughput: inference, {len(_configs(rs, modes))} arms x {reps} interleaved repeats")
    inf = _rows_from_times(timed_sweep(model, infer, _configs(rs, modes), reps, device), batch)
    for row in inf:
        if row["mode"] != "off":
            row["flops_ratio_est"] = tofu.flops_ratio(n_tokens, row["r"], 12, 192)
            tofu.apply(model, r=row["r"], **MODES[row["mode"]])
            row["final_tokens"] = tofu.token_counts(model, x[:1])[-1]
            tofu.remove(model)
        else:
            row["flops_ratio_est"], row["final_tokens"] = 1.0, n_tokens

    xt, yt = x[:train_batch], torch.arange(train_batch, device=device) % 1000
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model.train()

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xt), yt).backward()
        opt.step()

    # training arms without proportional attention (ToMe's advice for training, spec §3.8)
    progress_print(f"[tofu] throughput: training step, {len(_configs(train_rs, modes))} arms")
    tr = _rows_from_times(timed_sweep(model, train_step, _configs(train_rs, modes), max(2, reps // 2), device,
                                      proportional_attention=False), train_batch)
    return dict(model="ViT-Ti/16 (timm, 192-d, 12 blocks, 3 heads)", tokens=n_tokens, img_size=img_size,
                batch=batch, train_batch=train_batch, device=str(device), threads=torch.get_num_threads(),
                inference=inf, training=tr)


# ------------------------------------------------------------------------------------------ accuracy

def _data(source: str, upsample: int | None = None):
    from fedfuse.data import load_source

    train, test = load_source(source)
    xtr, xte = train.x.float(), test.x.float()
    if upsample:
        xtr = F.interpolate(xtr, size=(upsample, upsample), mode="bilinear", align_corners=False)
        xte = F.interpolate(xte, size=(upsample, upsample), mode="bilinear", align_corners=False)
    return xtr, train.y.long(), xte, test.y.long()


def _build(kind: str, seed: int = 0) -> tuple[nn.Module, str, int | None]:
    """``(model, data source, upsample)`` for the two accuracy set-ups."""
    from fedfuse.models import build_model

    if kind == "project_mnist1d":
        return (build_model("vit", 10, (1, 40), width=64, depth=4, seed=seed, patch_size=2, num_heads=4),
                "mnist1d", None)
    if kind == "proxy_digits32":
        return (build_model("vit", 10, (1, 32, 32), width=64, depth=8, seed=seed, patch_size=4, num_heads=4,
                            mlp_ratio=4.0), "digits", 32)
    raise ValueError(kind)


def train_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, device: torch.device,
                seed: int = 0, batch_size: int = 64, lr: float = 1e-3) -> float:
    """AdamW (weight decay 0.05) + one-cycle schedule, label smoothing 0.1; returns wall seconds."""
    recipe = Recipe(epochs=epochs, lr=lr, optimizer="adamw", weight_decay=0.05, label_smoothing=0.1, patience=0,
                    schedule="onecycle", batch_size=batch_size)
    return train_client(model, x, y, recipe, seed=seed, device=device)["train-seconds"]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch: int = 256) -> float:
    model.eval()
    correct = 0
    for s in range(0, len(x), batch):
        correct += (model(x[s:s + batch].to(device)).argmax(1).cpu() == y[s:s + batch]).sum().item()
    return correct / len(x)


TRAIN_HP = {  # per set-up (batch size, peak lr): the digits proxy has few samples, so small batches
    "project_mnist1d": dict(batch_size=64, lr=1e-3),
    "proxy_digits32": dict(batch_size=32, lr=2e-3),
}


def part_accuracy(device: torch.device, setups: dict[str, list[int]], modes: list[str], epochs: dict[str, int],
                  reps: int, train_tofu_r: int, seed: int = 0) -> dict:
    out: dict = dict(device=str(device), threads=torch.get_num_threads(), setups={})
    for kind, rs in progress(list(setups.items()), desc="tofu accuracy", unit="set-up"):
        progress_print(f"[tofu] accuracy: {kind}: training {epochs[kind]} epochs, then {len(_configs(rs, modes))} arms")
        model, source, up = _build(kind, seed)
        xtr, ytr, xte, yte = _data(source, up)
        sec = train_model(model, xtr, ytr, epochs[kind], device, seed, **TRAIN_HP[kind])
        n_tokens = tofu.token_counts(model, xte[:1].to(device))[0]
        rows = []
        for mode, r in _configs(rs, modes):
            _set(model, mode, r)
            counts = tofu.token_counts(model, xte[:1].to(device))
            rows.append(dict(mode=mode, r=r, accuracy=accuracy(model, xte, yte, device), final_tokens=counts[-1]))
        tofu.remove(model)
        off = rows[0]["accuracy"]
        for row in rows:
            row["delta_points"] = 100 * (row["accuracy"] - off)
        # inference throughput of this very model at batch 32 (same interleaved protocol)
        xb = xte[:32].to(device)

        def infer() -> None:
            with torch.inference_mode():
                model(xb)

        thr = {(t["mode"], t["r"]): t for t in _rows_from_times(
            timed_sweep(model, infer, _configs(rs, modes), reps, device), len(xb))}
        for row in rows:
            row["speedup"] = thr[(row["mode"], row["r"])]["speedup"]
            row["images_per_s"] = thr[(row["mode"], row["r"])]["images_per_s"]
        setup = dict(source=source, upsample=up, tokens=n_tokens, depth=len(model.blocks),
                     width=model.embed_dim, epochs=epochs[kind], train_seconds=sec, n_train=len(xtr),
                     n_test=len(xte), rows=rows)
        if kind == "proxy_digits32" and train_tofu_r > 0:
            # (c) train the same architecture from the same init *with* ToFu (prop-attn off)
            m2, _, _ = _build(kind, seed)
            tofu.apply(m2, r=train_tofu_r, proportional_attention=False)
            sec2 = train_model(m2, xtr, ytr, epochs[kind], device, seed, **TRAIN_HP[kind])
            acc_on = accuracy(m2, xte, yte, device)
            with tofu.suspended(m2):
                acc_off = accuracy(m2, xte, yte, device)
            setup["train_with_tofu"] = dict(r=train_tofu_r, mode="tofu", train_seconds=sec2,
                                            train_speedup=sec / sec2, accuracy_eval_tofu=acc_on,
                                            accuracy_eval_off=acc_off, baseline_accuracy_off=off)
        setup["train_hp"] = TRAIN_HP[kind]
        out["setups"][kind] = setup
    return out


# ----------------------------------------------------------------------------------------- federated

def federated_run(kind: str = "proxy_digits32", num_clients: int = 3, rounds: int = 3, local_epochs: int = 1,
                  tofu_r: int = 4, partitioning: str = "iid", device: str | torch.device = "auto", seed: int = 0,
                  lr: float = 2e-3, batch_size: int = 32) -> dict:
    """FedAvg in plain PyTorch, once with ToFu off and once with ``tofu_r`` during local training.

    Both arms use the same data partitions (``fedfuse.data.partition_indices``), the same initial
    global model and the same per-client shuffling seeds. Local training uses ToFu (MLERP hybrid,
    proportional attention off); the aggregated global model is evaluated with ToFu off and on.
    Returns per-round client training seconds (sum over clients) and accuracies for both arms.
    """
    from fedfuse.data import partition_indices
    from fedfuse.fusion.average import average_state_dicts

    device = resolve_device(device)
    init, source, up = _build(kind, seed)
    xtr, ytr, xte, yte = _data(source, up)
    parts = partition_indices(ytr, num_clients, partitioning, seed=seed)
    weights = [len(p) / sum(len(q) for q in parts) for p in parts]
    out: dict = dict(kind=kind, source=source, clients=num_clients, rounds=rounds, local_epochs=local_epochs,
                     partitioning=partitioning, tofu_r=tofu_r, device=str(device), threads=torch.get_num_threads(),
                     client_sizes=[len(p) for p in parts], arms={})
    arms = {"off": 0, "tofu": tofu_r}
    globals_ = {arm: copy.deepcopy(init).to(device) for arm in arms}
    per_round: dict[str, list[dict]] = {arm: [] for arm in arms}
    for rnd in progress(range(rounds), desc="tofu federated", unit="round"):
        states: dict[str, list] = {arm: [] for arm in arms}
        secs: dict[str, list[float]] = {arm: [] for arm in arms}
        for k, idx in enumerate(parts):
            for arm, r in arms.items():  # arms interleaved per client: CPU contention hits both alike
                local = copy.deepcopy(globals_[arm])
                if r > 0:
                    tofu.apply(local, r=r, proportional_attention=False)
                idx_t = torch.as_tensor(idx)
                info = train_client(local, xtr[idx_t], ytr[idx_t], plain_recipe(local_epochs, lr, batch_size),
                                    seed=seed * 1000 + rnd * 100 + k, device=device)  # same batches in both arms
                secs[arm].append(info["train-seconds"])
                tofu.remove(local)  # weights are untouched by ToFu: aggregation is plain FedAvg
                states[arm].append(local.state_dict())
        for arm in arms:
            globals_[arm].load_state_dict(average_state_dicts(states[arm], weights))
            per_round[arm].append(dict(round=rnd + 1, client_train_seconds=secs[arm],
                                       total_train_seconds=sum(secs[arm]),
                                       accuracy_off=accuracy(globals_[arm], xte, yte, device)))
        progress_print(f"[tofu] federated round {rnd + 1}/{rounds}: " + ", ".join(
            f"{arm} acc {per_round[arm][-1]['accuracy_off']:.3f} train {per_round[arm][-1]['total_train_seconds']:.1f} s"
            for arm in arms))
    for arm, r in arms.items():
        g = globals_[arm]
        acc_off = per_round[arm][-1]["accuracy_off"]
        with tofu.tofu(g, r=max(tofu_r, 1)):
            acc_on = accuracy(g, xte, yte, device)
        out["arms"][arm] = dict(r=r, rounds=per_round[arm], final_accuracy_eval_off=acc_off,
                                final_accuracy_eval_tofu=acc_on,
                                mean_round_train_seconds=statistics.mean(
                                    p["total_train_seconds"] for p in per_round[arm]))
    out["train_time_speedup"] = (out["arms"]["off"]["mean_round_train_seconds"]
                                 / out["arms"]["tofu"]["mean_round_train_seconds"])
    return out


# ------------------------------------------------------------------------------------------ reporting

def _fmt(v: float, nd: int = 3) -> str:
    return f"{v:.{nd}f}"


def markdown(results: dict[str, dict]) -> str:
    """One markdown report from whichever part results exist."""
    quick = [p for p, v in results.items() if v.get("quick")]
    lines = ["# ToFu benchmark (issue #7)", "",
             *([f"**Smoke-run (--quick) numbers, not results: {', '.join(quick)}**", ""] if quick else []),
             "All ratios are relative to ToFu *off* measured in the same run (interleaved, median). "
             "Modes: `tofu` = prune in blocks < depth/2, then MLERP; `tofu_avg` = prune, then average; "
             "`tome` = average in every block; `prune` = prune in every block.", ""]
    if "throughput" in results:
        t = results["throughput"]
        lines += [f"## Throughput: {t['model']}, {t['tokens']} tokens, random input, device {t['device']}, "
                  f"{t['threads']} thread(s)", "",
                  f"Inference batch {t['batch']}; training step (fwd+bwd+SGD, prop. attention off) batch "
                  f"{t['train_batch']}.", "",
                  "| phase | mode | r | final tokens | est. FLOPs ratio | img/s | speed-up vs off |",
                  "|---|---|---|---|---|---|---|"]
        for phase in ("inference", "training"):
            for row in t[phase]:
                lines.append(f"| {phase} | {row['mode']} | {row['r']} | {row.get('final_tokens', '')} | "
                             f"{_fmt(row['flops_ratio_est'], 2) if 'flops_ratio_est' in row else ''} | "
                             f"{row['images_per_s']:.1f} | {_fmt(row['speedup'], 2)}× |")
        lines.append("")
    if "accuracy" in results:
        a = results["accuracy"]
        for kind, s in a["setups"].items():
            up = f", upsampled to {s['upsample']}×{s['upsample']}" if s["upsample"] else ""
            lines += [f"## Accuracy: `{kind}` ({s['source']}{up}; {s['tokens']} tokens, {s['depth']} blocks, "
                      f"width {s['width']}; trained {s['epochs']} epochs with ToFu off; test n={s['n_test']})", "",
                      "| mode | r | final tokens | accuracy | Δ points vs off | inference speed-up (batch 32) |",
                      "|---|---|---|---|---|---|"]
            for row in s["rows"]:
                lines.append(f"| {row['mode']} | {row['r']} | {row['final_tokens']} | {_fmt(row['accuracy'])} | "
                             f"{row['delta_points']:+.2f} | {_fmt(row['speedup'], 2)}× |")
            if "train_with_tofu" in s:
                w = s["train_with_tofu"]
                lines += ["", f"Training *with* ToFu (`tofu`, r={w['r']}, prop. attention off), same init/epochs: "
                          f"train time {w['train_seconds']:.1f} s vs {s['train_seconds']:.1f} s off "
                          f"(**{w['train_speedup']:.2f}×**); test accuracy {_fmt(w['accuracy_eval_tofu'])} "
                          f"(eval with ToFu) / {_fmt(w['accuracy_eval_off'])} (eval off) vs "
                          f"{_fmt(w['baseline_accuracy_off'])} for the model trained off."]
            lines.append("")
    if "federated" in results:
        f = results["federated"]
        lines += [f"## Federated end-to-end: `{f['kind']}` ({f['source']}), {f['clients']} clients "
                  f"({f['partitioning']}, sizes {f['client_sizes']}), {f['rounds']} FedAvg rounds × "
                  f"{f['local_epochs']} local epochs, ToFu r={f['tofu_r']} in local training", "",
                  "| arm | mean client-training s / round | per-round s | final acc (eval off) | "
                  "final acc (eval ToFu) |", "|---|---|---|---|---|"]
        for arm, v in f["arms"].items():
            per = ", ".join(f"{p['total_train_seconds']:.1f}" for p in v["rounds"])
            lines.append(f"| {arm} (r={v['r']}) | {v['mean_round_train_seconds']:.1f} | {per} | "
                         f"{_fmt(v['final_accuracy_eval_off'])} | {_fmt(v['final_accuracy_eval_tofu'])} |")
        lines += ["", f"Client training speed-up with ToFu: **{f['train_time_speedup']:.2f}×**.", ""]
    return "\n".join(lines)


def _save(part: str, data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{part}.json").write_text(json.dumps(data, indent=1))
    found = {p: json.loads((RESULTS / f"{p}.json").read_text())
             for p in ("throughput", "accuracy", "federated") if (RESULTS / f"{p}.json").exists()}
    (RESULTS / "tofu_benchmark.md").write_text(markdown(found))


def main(argv: list[str] | None = None) -> None:
    global RESULTS
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.tofu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--part", choices=["throughput", "accuracy", "federated", "all"], default="all")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    ap.add_argument("--modes", default="tofu,tofu_avg,tome,prune")
    ap.add_argument("--rs", default="4,8,13,16", help="r sweep for the ViT-Ti throughput")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--train-rs", default="8,13")
    ap.add_argument("--acc-setups", default="project_mnist1d,proxy_digits32",
                    help="accuracy set-ups to (re)run; others already in accuracy.json are kept")
    ap.add_argument("--fed-clients", type=int, default=3)
    ap.add_argument("--fed-rounds", type=int, default=3)
    ap.add_argument("--fed-epochs", type=int, default=1)
    ap.add_argument("--fed-r", type=int, default=4)
    ap.add_argument("--fed-kind", default="proxy_digits32", choices=["proxy_digits32", "project_mnist1d"])
    args = ap.parse_args(argv)
    RESULTS = Path(args.out)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    modes = args.modes.split(",")
    parts = ["throughput", "accuracy", "federated"] if args.part == "all" else [args.part]
    for part in parts:
        t0 = time.perf_counter()
        progress_print(f"[tofu] {part}: started{' (quick)' if args.quick else ''}")
        if part == "throughput":
            rs = [int(v) for v in args.rs.split(",")]
            train_rs = [int(v) for v in args.train_rs.split(",")]
            data = (part_throughput(device, rs[:1], modes[:2], 4, 1, train_rs[:1], 2, img_size=64) if args.quick
                    else part_throughput(device, rs, modes, args.batch, args.reps, train_rs, args.train_batch))
        elif part == "accuracy":
            if args.quick:
                data = part_accuracy(device, {"project_mnist1d": [2], "proxy_digits32": [4]}, modes[:2],
                                     {"project_mnist1d": 1, "proxy_digits32": 1}, 1, 4, args.seed)
            else:
                sweep = {"project_mnist1d": [1, 2, 3, 4], "proxy_digits32": [2, 4, 6, 8]}
                chosen = {k: sweep[k] for k in args.acc_setups.split(",")}
                data = part_accuracy(device, chosen, modes, {"project_mnist1d": 10, "proxy_digits32": 12},
                                     args.reps, 4, args.seed)
                old = RESULTS / "accuracy.json"
                if old.exists() and not json.loads(old.read_text()).get("quick"):
                    prev = json.loads(old.read_text())["setups"]
                    data["setups"] = {**{k: v for k, v in prev.items() if k not in chosen}, **data["setups"]}
        else:
            data = (federated_run(rounds=1, local_epochs=1, tofu_r=args.fed_r, device=device, seed=args.seed,
                                  num_clients=2) if args.quick
                    else federated_run(kind=args.fed_kind, num_clients=args.fed_clients, rounds=args.fed_rounds,
                                       local_epochs=args.fed_epochs, tofu_r=args.fed_r, device=device,
                                       seed=args.seed))
        data["wall_seconds"] = time.perf_counter() - t0
        data["quick"] = args.quick
        _save(part, data)
        print(f"[tofu] {part} done in {data['wall_seconds']:.0f} s → {RESULTS / (part + '.json')}")
    print((RESULTS / "tofu_benchmark.md").read_text())


if __name__ == "__main__":
    main()
