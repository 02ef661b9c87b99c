"""The zoo acceptance table: which alignment method takes which model users bring, and whether it is exact where
it has to be.

For each model of ``ZOO`` (num_classes = 10, random init, eval mode, 3x32x32 inputs) and each method of
``METHODS``, on the fusion set ``x = torch.randn(32, 3, 32, 32)`` (seeded), after the model's BatchNorm statistics
are set from ``x`` with ``fedfuse.fusion.permute.reset_bn_stats(m, x)`` (BN statistics re-estimated on the fusion
set are then the same for m, its copies and its permutations):

- **accepted**: ``fuse(method, [m, m], fusion_inputs=x)`` returns a model (a ``FusionError`` is a refusal, any other
  exception a failure: both recorded with the exception type and the first line of its message);
- **(i) self-fusion**: that model computes m's function on ``x`` (relative output error
  ``‖f(x) − m(x)‖ / ‖m(x)‖ ≤ 1e-5``);
- **(ii) permutation**: ``P(m) = permute_model(m, random_perms(build_spec(m), seed))`` computes m's function (one
  check per model: it says whether the structure reader's permutation groups are the model's symmetries);
- **(iii) matching** (``rebasin``, ``ot``, ``kf-linear``, ``hf-linear``): ``fuse(method, [m, P(m)])`` computes
  m's function (the method finds the permutation back).

Every check runs in **float64** (``--dtype``, default float64): the models are converted (``model.double()``, BN
statistics then set from ``x.double()``), fused on ``x.double()`` (every method computes in its models' dtype) and
evaluated in float64, as ``tests/test_any_model.py`` does. In float32 a deep network's refitted layers (neuron
interpolation's least squares, tens of them in a MobileNet) and a permuted summation order round to relative errors
of 1e-5 … 1e-4 on the large models, which would be mistaken for an inexact fusion; in float64 that round-off is
about 1e-12, so an error above the tolerance is the method's. ``--dtype float32`` runs the models as users train
them. Seconds are those of the float64 calls (``simulations/bench/zoo_cost.py`` times float32 against the floor).

It also checks that ``fuse`` left m unchanged. Gradient methods run with ``epochs=2, head_epochs=2`` and
``fs-merge`` with ``steps=20`` (``OPTIONS``): the checks are about exactness, not about training. Seconds per
``fuse`` call are wall-clock on a shared machine (compare them with each other only). Each (model, method) runs in
a worker process of its own with a hard limit of ``--timeout`` seconds and ``--mem-gb`` GiB of address space: a
call running past them is recorded as ``timeout`` / ``failed`` (e.g. torch's "can't allocate memory") and the
table goes on (``--in-process``: no workers, no hard limits).

    .venv/bin/python -m simulations.bench.zoo_table                                   # everything
    .venv/bin/python -m simulations.bench.zoo_table --models net,tv:resnet18 --methods ot,rebasin
    .venv/bin/python -m simulations.bench.zoo_table --table-only                      # table.md from runs.json

Writes ``results/zoo-table/runs.json`` (one record per (model, method, check); a rerun with filters replaces only
the records it reran) and ``results/zoo-table/table.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.fusion.permute import build_spec, reset_bn_stats  # noqa: E402
from fedfuse.fusion.permute.maps import permute_model, random_perms  # noqa: E402
from fedfuse.fusion.registry import FusionError  # noqa: E402
from fedfuse.models import build_model, set_example_input  # noqa: E402
from simulations.bench.zoo_oneshot import CODE, Net, ResidualCNN  # noqa: E402

TOL = 1e-5
DTYPE = torch.float64   # --dtype float32: the models as users train them (round-off of refitted layers included)
SHAPE = (3, 32, 32)
METHODS = ["kf-linear", "hf-linear", "kf-gradient", "hf-gradient", "ot", "rebasin", "transfusion", "fs-merge"]
MATCHING = ("rebasin", "ot", "kf-linear", "hf-linear")
OPTIONS = {"kf-gradient": {"epochs": 2, "head_epochs": 2}, "hf-gradient": {"epochs": 2, "head_epochs": 2},
           "fs-merge": {"steps": 20}}


class ListMLP(nn.Module):
    """An MLP as a user writes it: layers in an ``nn.ModuleList``, functional activations, ``torch.flatten``."""

    def __init__(self, in_features: int = 3 * 32 * 32, hidden: tuple[int, ...] = (256, 128), num_classes: int = 10):
        super().__init__()
        sizes = (in_features, *hidden, num_classes)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        x = torch.flatten(x, 1)
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def _zoo(name: str):
    return lambda: build_model(name, 10, SHAPE)


#: key -> (what it is, builder); ``tv:``/``timm:`` keys are ``build_model('torchvision:'/'timm:' ...)``
ZOO = {
    "net": ("Flower quickstart-pytorch Net (3x32x32)", lambda: Net(3, 32)),
    "mlp": ("MLP: nn.ModuleList, F.relu, torch.flatten", ListMLP),
    "rescnn": ("CNN with hand-written skips x + block(x), BatchNorm", lambda: ResidualCNN(3)),
    **{f"tv:{n}": (f"torchvision {n}", _zoo(f"torchvision:{n}"))
       for n in ("vgg11_bn", "resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "densenet121",
                 "convnext_tiny")},
    **{f"timm:{n}": (f"timm {n}" + (" (img_size=32, patch_size=4)" if n.startswith("vit") else ""),
                     _zoo(f"timm:{n}"))
       for n in ("resnet18", "convnext_atto", "efficientnet_b0", "vit_tiny_patch16_224")},
    # not in the list
    "tv:shufflenet_v2_x0_5": ("torchvision shufflenet_v2_x0_5 (not in the issue's list)",
                              _zoo("torchvision:shufflenet_v2_x0_5")),
    "tv:regnet_x_400mf": ("torchvision regnet_x_400mf (not in the issue's list)", _zoo("torchvision:regnet_x_400mf")),
    "tv:squeezenet1_0": ("torchvision squeezenet1_0 (not in the issue's list)", _zoo("torchvision:squeezenet1_0")),
    "timm:mobilenetv3_small_050": ("timm mobilenetv3_small_050 (not in the issue's list)",
                                   _zoo("timm:mobilenetv3_small_050")),
    **{f"tv:{n}": (f"torchvision {n} (not in the issue's list)", _zoo(f"torchvision:{n}"))
       for n in ("mnasnet0_5", "googlenet", "resnext50_32x4d", "swin_t")},
    **{f"timm:{n}": (f"timm {n} (not in the issue's list)", _zoo(f"timm:{n}"))
       for n in ("resnet10t", "regnetx_002", "ghostnet_050", "mixer_s16_224", "resmlp_12_224", "edgenext_xx_small",
                 "mobilevit_xxs")},
}


class CallTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CallTimeout("call ran past --timeout")


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:400]}"


def _kind(exc: BaseException) -> str:
    if isinstance(exc, CallTimeout):
        return "timeout"
    return "refused" if isinstance(exc, FusionError) else "failed"


@torch.no_grad()
def _out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model``'s outputs on ``x``, computed in float64 on a float64 copy (the model itself is left as it is), so
    that float32 round-off of a deep net's summation order is not mistaken for an inexact fusion."""
    return copy.deepcopy(model).double().eval()(x.double())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _guarded(fn, timeout: float):
    """``(value, None)`` or ``(None, exception)``; the call is stopped after ``timeout`` seconds."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(), None, None
    except Exception as exc:  # noqa: BLE001 - every exception is a recorded outcome
        return None, exc, traceback.format_exc(limit=-6)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def check_model(key: str, methods: list[str], seed: int, timeout: float, model_checks: bool = True) -> list[dict]:
    """The records of ``key``'s checks: the model-level ones (build, BN reset, (ii)) when ``model_checks``, and
    (i) / (iii) for each of ``methods``."""
    what, make = ZOO[key]
    records = []
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    try:
        m = make().eval()
    except Exception as exc:  # noqa: BLE001
        return [{"model": key, "method": None, "check": "build", "outcome": _kind(exc), "reason": _reason(exc)}]
    build_s = time.perf_counter() - t0
    m = m.to(DTYPE)   # the fuse calls too: each method computes in the models' dtype (its exactness, not round-off)
    x = torch.randn(32, *SHAPE, generator=torch.Generator().manual_seed(seed)).to(DTYPE)
    set_example_input(m, x)
    params = sum(p.numel() for p in m.parameters())
    try:
        reset_bn_stats(m, x)
    except Exception as exc:  # noqa: BLE001
        records.append({"model": key, "method": None, "check": "reset_bn_stats", "outcome": _kind(exc),
                        "reason": _reason(exc)})
    m.eval()
    ref = _out(m, x)
    state0 = {k: v.clone() for k, v in m.state_dict().items()}
    base = {"model": key, "what": what, "parameters": params, "build-seconds": build_s, "code": CODE,
            "dtype": str(DTYPE).removeprefix("torch.")}
    print(f"{key}: {params:,} parameters", flush=True)

    # (ii) the structure reader's permutation is m's symmetry
    pm, perm_rec = None, {**base, "method": None, "check": "ii-permute"}
    t0 = time.perf_counter()
    val, exc, tb = _guarded(lambda: permute_model(m, random_perms(build_spec(m), seed + 1)), timeout)
    perm_rec["seconds"] = time.perf_counter() - t0
    if exc is not None:
        perm_rec.update(outcome=_kind(exc), reason=_reason(exc), traceback=tb)
    else:
        pm = val.eval()
        set_example_input(pm, x)
        e = rel_err(_out(pm, x), ref)
        moved = sum(not torch.equal(a, b) for a, b in zip(m.state_dict().values(), pm.state_dict().values()))
        perm_rec.update(outcome="ok", error=e, exact=e <= TOL, tensors_moved=moved,
                        groups=len(build_spec(m).groups))
    if model_checks:
        records.append(perm_rec)
    else:
        records = []
    print(f"  (ii) permute: {perm_rec.get('outcome')} {perm_rec.get('error', perm_rec.get('reason', ''))}", flush=True)

    for method in methods:
        opts = OPTIONS.get(method, {})
        pairs = [("i-self", lambda: [m, m])]
        if method in MATCHING:
            pairs.append(("iii-match", lambda: [m, pm]))
        for check, models_of in pairs:
            rec = {**base, "method": method, "check": check, "options": opts}
            if check == "iii-match" and pm is None:
                rec.update(outcome="not run", reason="P(m) could not be built (check ii)")
                records.append(rec)
                continue
            t0 = time.perf_counter()
            res, exc, tb = _guarded(lambda: fuse_result(method, models_of(), fusion_inputs=x, seed=seed, **opts),
                                    timeout)
            rec["seconds"] = time.perf_counter() - t0
            if exc is not None:
                rec.update(outcome=_kind(exc), reason=_reason(exc), traceback=tb)
            else:
                out, exc2, tb2 = _guarded(lambda: _out(res.model, x), timeout)
                if exc2 is not None:
                    rec.update(outcome="failed", reason="fused model's forward: " + _reason(exc2), traceback=tb2)
                else:
                    e = rel_err(out, ref)
                    rec.update(outcome="ok", error=e, exact=e <= TOL,
                               same_architecture=list(res.model.state_dict()) == list(state0))
            if not _state_equal(m.state_dict(), state0):
                rec["input-modified"] = True
                m.load_state_dict(state0)
            records.append(rec)
            shown = f"err {rec['error']:.2e} {'exact' if rec['exact'] else 'NOT exact'}" if rec["outcome"] == "ok" \
                else f"{rec['outcome']}: {rec['reason']}"
            print(f"  {method:<12} {check:<9} {shown}  {rec['seconds']:.2f}s", flush=True)
    return records


# ------------------------------------------------------------------------------------------------ the table
def _cell(recs: dict[str, dict]) -> str:
    i = recs.get("i-self")
    if i is None:
        return ""
    if i["outcome"] != "ok":
        return {"refused": "refused", "failed": "**FAILED**", "timeout": "timeout"}.get(i["outcome"], i["outcome"])
    parts = [f"i {'✓' if i['exact'] else '✗ ' + format(i['error'], '.0e')}"]
    iii = recs.get("iii-match")
    if iii is not None:
        if iii["outcome"] == "ok":
            parts.append(f"iii {'✓' if iii['exact'] else '✗ ' + format(iii['error'], '.0e')}")
        else:
            parts.append(f"iii {iii['outcome']}")
    secs = [r["seconds"] for r in recs.values() if "seconds" in r]
    return " · ".join(parts) + f" · {max(secs):.1f}s"


def pair_status(recs: dict[str, dict]) -> tuple[bool, bool]:
    """(accepted, exact): accepted = the self-fusion ran; exact = every check of the pair ran and passed."""
    i = recs.get("i-self")
    accepted = i is not None and i["outcome"] == "ok"
    exact = accepted and all(r.get("outcome") == "ok" and r.get("exact") for r in recs.values())
    return accepted, exact


def write_table(out: Path, records: list[dict]) -> tuple[str, str]:
    models = [k for k in ZOO if any(r["model"] == k for r in records)]
    methods = [m for m in METHODS if any(r.get("method") == m for r in records)]
    by = {}
    for r in records:
        by.setdefault((r["model"], r.get("method")), {})[r["check"]] = r
    head = ["| model | params | (ii) P(m) ≡ m | " + " | ".join(f"`{m}`" for m in methods) + " |",
            "|---|---|---|" + "---|" * len(methods)]
    lines = []
    n_acc = n_exact = n_total = 0
    per_method = {m: [0, 0, 0] for m in methods}
    problems = []
    for key in models:
        perm = by.get((key, None), {}).get("ii-permute")
        if perm is None:
            pcell = ""
        elif perm["outcome"] == "ok":
            pcell = "✓" if perm["exact"] else f"✗ {perm['error']:.0e}"
        else:
            pcell = perm["outcome"]
        if perm is not None and not (perm["outcome"] == "ok" and perm["exact"]):
            problems.append((key, "(ii) permute_model", perm.get("reason") or f"error {perm['error']:.2e}"))
        for r in by.get((key, None), {}).values():
            if r["check"] in ("build", "reset_bn_stats"):
                problems.append((key, r["check"], r["reason"]))
        cells = []
        if "build" in by.get((key, None), {}):   # no model: every pair of it counts, none accepted
            n_total += len(methods)
            for method in methods:
                per_method[method][0] += 1
            lines.append(f"| `{key}` | | build failed | " + " | ".join("" for _ in methods) + " |")
            continue
        params = next((r.get("parameters") for r in records if r["model"] == key and r.get("parameters")), None)
        for method in methods:
            recs = by.get((key, method), {})
            if not recs:
                cells.append("")
                continue
            acc_, ex = pair_status(recs)
            n_total += 1
            n_acc += acc_
            n_exact += ex
            per_method[method][0] += 1
            per_method[method][1] += acc_
            per_method[method][2] += ex
            cells.append(_cell(recs))
            for check, r in sorted(recs.items()):
                if r["outcome"] != "ok":
                    problems.append((key, f"{method} ({check})", f"{r['outcome']}: {r.get('reason', '')}"))
                elif not r.get("exact"):
                    problems.append((key, f"{method} ({check})", f"not exact: relative error {r['error']:.2e}"))
                if r.get("input-modified"):
                    problems.append((key, f"{method} ({check})", "fuse modified the input model"))
        pstr = f"{params / 1e6:.2f}M" if params else ""
        lines.append(f"| `{key}` | {pstr} | {pcell} | " + " | ".join(cells) + " |")
    summary = (f"pairs accepted: {n_acc} / {n_total}; accepted and exact (every check of the pair within "
               f"{TOL:g}): {n_exact} / {n_total}")
    per = ["| method | accepted | exact |", "|---|---|---|"] + \
        [f"| `{m}` | {a} / {t} | {e} / {t} |" for m, (t, a, e) in per_method.items()]
    perm_ok = sum(1 for k in models if (p := by.get((k, None), {}).get("ii-permute")) and p["outcome"] == "ok"
                  and p["exact"])
    text = "\n".join([
        "# Zoo acceptance table", "",
        "Written by `simulations/bench/zoo_table.py` (its docstring: the checks). Every model: num_classes = 10, "
        "random init, eval mode, BatchNorm statistics set from the fusion set `x = torch.randn(32, 3, 32, 32)` "
        "(seed 0). Cell: `i` = fuse(method, [m, m]) ≡ m, `iii` = fuse(method, [m, P(m)]) ≡ m (matching methods), "
        f"✓ = relative output error ≤ {TOL:g}, outputs computed in float64 (✗ shows the error), then the slowest "
        "fuse call's seconds (a shared 2-core machine: compare the seconds with each other only). `refused`: a "
        "`FusionError` (the "
        "method declined the model), **FAILED**: any other exception. Gradient methods: epochs=2, head_epochs=2; "
        "fs-merge: steps=20.", "",
        f"**{summary}**; P(m) ≡ m for {perm_ok} / {len(models)} models.", "",
        *head, *lines, "", "## Per method", "", *per, "",
        "## Every refusal, failure and inexact result", "",
        "| model | method (check) | what |", "|---|---|---|",
        *[f"| `{k}` | {m} | {w.replace('|', '/')} |" for k, m, w in problems], ""])
    (out / "table.md").write_text(text)
    return text, summary


def _hard_failure(key: str, method: str, outcome: str, reason: str) -> list[dict]:
    checks = ["i-self"] + (["iii-match"] if method in MATCHING else [])
    return [{"model": key, "what": ZOO[key][0], "method": method, "check": c, "options": OPTIONS.get(method, {}),
             "outcome": outcome, "reason": reason} for c in checks]


def run_isolated(key: str, method: str | None, a) -> list[dict]:
    """One worker process for ``key``'s model-level checks (``method`` None) or one method's checks, with a hard
    wall-clock limit (``--timeout``) and an address-space limit (``--mem-gb``): a call that runs away (hours, or
    more memory than the machine has) becomes a ``timeout`` / ``failed`` record instead of stopping the table."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res_path = Path(tmp) / "records.json"
        cmd = [sys.executable, "-m", "simulations.bench.zoo_table", "--worker", str(res_path), "--models", key,
               "--methods", method or "none", "--seed", str(a.seed), "--timeout", str(a.timeout),
               "--mem-gb", str(a.mem_gb), "--dtype", a.dtype]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 60)
        except subprocess.TimeoutExpired:
            return [] if method is None else _hard_failure(
                key, method, "timeout", f"no result in {a.timeout + 60:.0f} s (worker killed)")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ")]
        for ln in lines:
            print(ln, flush=True)
        if res_path.exists():
            return json.loads(res_path.read_text())
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
        why = (f"worker died (exit code {proc.returncode}, after {time.perf_counter() - t0:.0f} s"
               f"{'; killed: out of memory?' if proc.returncode < 0 else ''}): {tail}")
        if method is None:
            return [{"model": key, "what": ZOO[key][0], "method": None, "check": "build", "outcome": "failed",
                     "reason": why}]
        return _hard_failure(key, method, "failed", why)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ZOO), help=f"comma list of {list(ZOO)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per (model, method) worker")
    ap.add_argument("--mem-gb", type=float, default=8.0, help="address-space limit of a worker, GiB")
    ap.add_argument("--in-process", action="store_true", help="no worker processes (no hard limits)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                    help="the models' and the fusion set's dtype in every check")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="results/zoo-table")
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, a.dtype)
    torch.set_num_threads(1)
    if a.worker:   # one isolated job of run_isolated: its records to the file a.worker
        import resource

        limit = int(a.mem_gb * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        methods = [] if a.methods == "none" else a.methods.split(",")
        recs = check_model(a.models, methods, a.seed, a.timeout, model_checks=not methods)
        Path(a.worker).write_text(json.dumps(recs))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.json"
    records = json.loads(path.read_text()) if path.exists() else []
    if not a.table_only:
        keys, methods = a.models.split(","), a.methods.split(",")
        bad = [k for k in keys if k not in ZOO] + [m for m in methods if m not in METHODS]
        if bad:
            ap.error(f"unknown models/methods {bad}")
        for key in keys:
            if a.in_process:
                new = check_model(key, methods, a.seed, a.timeout)
            else:
                print(f"{key}:", flush=True)
                new = run_isolated(key, None, a)
                if not any(r["check"] == "build" for r in new):
                    for method in methods:
                        new += run_isolated(key, method, a)
            # replace what was rerun: this model's model-level checks and the methods run now, in the file as it is
            # now (read again: a table run of other models that wrote it meanwhile keeps its records)
            records = json.loads(path.read_text()) if path.exists() else records
            records = [r for r in records if not (r["model"] == key and (r.get("method") is None
                                                                          or r.get("method") in methods))]
            records += new
            records.sort(key=lambda r: (list(ZOO).index(r["model"]) if r["model"] in ZOO else 99,
                                        METHODS.index(r["method"]) if r.get("method") in METHODS else -1))
            path.write_text(json.dumps(records, separators=(",", ":")) + "\n")   # compact, as results_index stores it
    text, summary = write_table(out, records)
    print(text)
    print(f"zoo_table: {summary}")


if __name__ == "__main__":
    main()
