"""timm ``vit_small_patch16_224`` pruned to 50% of its MACs: parameters, MACs and CPU latency as ratios.

Issue 14's pruning check (accuracy is not measurable offline: random initialisation, ``pretrained=False``,
nothing is downloaded). The unpruned model and its pruned variants are timed in **one process**, interleaved
(repeat 1 of every model, then repeat 2, ...; ``simulations.bench.timing.interleaved_timings``), one torch thread,
median wall time per batch; every latency is reported as a ratio to the unpruned model of the same run, so a
shared machine's load hits all models alike.

    .venv/bin/python -m simulations.bench.prune_vit_small --out results/pruning/vit_small.md
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from fedfuse.pruning import count_macs, count_params, prune_result
from simulations.bench.timing import interleaved_timings, medians


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--macs-ratio", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=8, help="images per timed forward pass")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--criterion", default="magnitude", help="importance (random weights: any criterion is arbitrary)")
    ap.add_argument("--out", default="results/pruning/vit_small.md")
    a = ap.parse_args(argv)
    import timm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    x_fusion = torch.randn(8, 3, 224, 224)
    variants = {
        "heads (default)": dict(),
        "heads, round_to=16": dict(round_to=16),
        "head_dims": dict(attention="head_dims"),
    }
    models = {"unpruned": model}
    infos = {}
    for name, opts in variants.items():
        t0 = time.perf_counter()
        res = prune_result(model, macs_ratio=a.macs_ratio, fusion_inputs=x_fusion, criterion=a.criterion, **opts)
        infos[name] = (res.info, time.perf_counter() - t0)
        models[name] = res.model.eval()
        print(name, {k: res.info[k] for k in ("params_ratio", "macs_ratio", "keep_fraction")},
              f"pruning took {infos[name][1]:.1f}s", flush=True)
    x = torch.randn(a.batch, 3, 224, 224)
    x1 = x[:1]
    cases = {}
    for name, m in models.items():
        cases[(name, a.batch)] = (lambda m=m: m(x))
        cases[(name, 1)] = (lambda m=m: m(x1))
    with torch.inference_mode():
        times = medians(interleaved_timings(cases, repeats=a.repeats, warmup=1))
    p0, c0 = count_params(model), count_macs(model, x1)
    lines = [f"# Structured pruning of timm `vit_small_patch16_224` to {a.macs_ratio:.0%} MACs (issue 14)", "",
             f"`python -m simulations.bench.prune_vit_small --batch {a.batch} --repeats {a.repeats}`: random "
             "initialisation (`pretrained=False`, no download; accuracy not measurable offline), importance "
             f"`{a.criterion}` on 8 random images, `fedfuse.pruning.prune(model, macs_ratio={a.macs_ratio})` with "
             "Torch-Pruning 1.6.1 (heads as units; embedding width, heads or head dims and MLP hidden units all keep "
             "the same fraction). Latency: CPU, 1 torch thread, median of "
             f"{a.repeats} interleaved repeats per model, all models timed in one process (other jobs shared the "
             "machine's 2 cores, so only the ratios are meaningful; they are measured interleaved for that "
             f"reason). {platform.processor() or platform.machine()}, torch {torch.__version__}, timm "
             f"{timm.__version__}. MACs: `torch.utils.flop_counter` per image (attention matmuls included).", "",
             f"| model | params (M) | params ratio | GMACs/image | MACs ratio | latency batch {a.batch} (s) | "
             f"speed-up batch {a.batch} | latency batch 1 (ms) | speed-up batch 1 | shape |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base_b, base_1 = times[("unpruned", a.batch)]["wall"], times[("unpruned", 1)]["wall"]
    for name, m in models.items():
        p, c = count_params(m), count_macs(m, x1)
        tb, t1 = times[(name, a.batch)]["wall"], times[(name, 1)]["wall"]
        blk = m.blocks[0]
        shape = (f"embed {m.embed_dim}, {blk.attn.num_heads} heads × {blk.attn.head_dim}, "
                 f"MLP {blk.mlp.fc1.out_features}")
        lines.append(f"| {name} | {p / 1e6:.2f} | {p / p0:.3f} | {c / 1e9:.2f} | {c / c0:.3f} | {tb:.3f} | "
                     f"{base_b / tb:.2f}× | {1e3 * t1:.1f} | {base_1 / t1:.2f}× | {shape} |")
    lines += ["", "Pruning time (s, same process): " + ", ".join(f"{n} {t:.1f}" for n, (_, t) in infos.items())]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
