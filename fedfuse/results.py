"""Run results: config, one row per round (JSON + CSV), a PNG accuracy plot, the final model.

``results.json`` = ``{"config", "rounds": [row, ...], **extra}``; the ServerApp's extras include the run's
fusion outcome (``fusion_outcome``): ``"status"`` (``"completed"`` | ``"failed"``), ``"error"``,
``"fallbacks"`` (count) and ``"fallback-rounds"``. A row's ``"fallback"`` is ``None`` or
``"<kind>: <reason>"`` (kind ``previous`` or ``average``); ``rounds.csv`` always has that column and the
plot marks those rounds.

``rounds.csv`` has one row per round and one column per scalar of the row; the lists
and records of a row are flattened: ``per-class-accuracy`` → ``class-<c>-accuracy``, ``client-test-accuracy``
→ ``client-<p>-test-accuracy`` (``p`` = the client's partition id when the row has ``client-partition-ids``,
else its position), ``rejected``/``failures`` → their count plus ``rejected-reasons``/``failure-reasons``
(``node <id>: <reason>`` joined by `` | ``), ``client-federated-accuracy`` (``{partition: accuracy}``, federated
evaluation) → ``client-<p>-federated-accuracy``; capacity tiers' ``tier-accuracy`` / ``tier-val-accuracy`` /
``tier-bytes-sent`` / ``tier-clients`` / ``tier-train-seconds`` (``{tier: value}``) → ``tier-<t>-test-accuracy``,
``tier-<t>-val-accuracy``, ``tier-<t>-bytes-sent``, ``tier-<t>-clients``, ``tier-<t>-train-seconds``. Other dicts
such as ``fusion-info`` stay in ``results.json`` only. The plot has one line per narrower tier's model, and in a
one-shot run one horizontal line per reference of ``"one-shot-references"`` (``fedfuse.references``).
"""

from __future__ import annotations

import math

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from fedfuse.hetero.tiers import tier_sort_key
from fedfuse.references import REFERENCE_LABELS


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v != v:
        return None
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    return v


def privacy_text(privacy: dict[str, Any] | None, epsilon: float | None = None) -> str:
    """A DP run's guarantee as the console, the tables and the plot titles print it: ``"DP (ε, δ) = (10.73, 1e-05)"``
    (``privacy``: ``results.json``'s record; ``epsilon``: another point of its account, e.g. before the head round);
    ``""`` without DP."""
    if not privacy or not isinstance(privacy.get("epsilon"), (int, float)):
        return ""
    eps = privacy["epsilon"] if epsilon is None else epsilon
    return f"DP (ε, δ) = ({eps:.2f}, {privacy.get('delta', float('nan')):g})"


def dp_noise_cause(privacy: dict[str, Any] | None) -> tuple[bool, str] | None:
    """``(the noise is the likely cause, the sentence that says so with its numbers)`` for a DP run's
    ``results.json`` ``privacy`` record (``PrivateRounds``' per-round ``noise-to-update``: the noise's expected norm
    over the norm of the mean clipped update); ``None`` without DP or without a measured round."""
    rounds = [r for r in (privacy or {}).get("rounds", []) if isinstance(r.get("noise-to-update"), (int, float))]
    if not rounds:
        return None
    last = rounds[-1]
    ratios = [float(r["noise-to-update"]) for r in rounds]
    span = f"; {min(ratios):.3g} to {max(ratios):.3g} over {len(ratios)} rounds" if len(ratios) > 1 else ""
    numbers = (f"noise of std σ·C/n = {last['noise-std']:.4g} on each of the {last['coordinates']} coordinates of the "
               f"average (norm ≈ {last['noise-norm']:.4g}) against a mean clipped update of norm "
               f"{last['update-norm']:.4g} in round {last['round']}: noise-to-update ratio {ratios[-1]:.3g}{span}")
    if ratios[-1] >= 1.0:
        return True, (f"differential privacy is on and its noise is the likely cause: {numbers}; lower "
                      "dp-options.noise-multiplier (a larger epsilon) or train with more clients per round (the noise "
                      "on the average shrinks as 1/n)")
    return False, f"the DP noise is smaller than the update ({numbers})"


def dead_model(rows: list[dict[str, Any]], num_classes: int, margin: float = 0.02,
               privacy: dict[str, Any] | None = None) -> str | None:
    """Why the run's last evaluated global model is dead (``None`` when it is not): after training, its loss is
    non-finite, or it sits at chance level (accuracy at most ``1/C + margin``, loss at least ``0.95·ln C``) while one
    class takes at least 80 % of the summed per-class accuracies (it has collapsed to one prediction, perhaps with a
    few stray hits: a model that merely has not learned yet still spreads its predictions). This catches a run that trains itself to a dead model (e.g. a diverging lr),
    which the divergence guard cannot see while the weights stay finite. Reads the central test columns (the
    collapse from ``per-class-accuracy``), else the federated ones (only a non-finite loss); rows without either
    are not judged. In a DP run (``privacy``: ``results.json``'s record) whose noise outweighs the mean clipped update,
    the reason names the noise with its noise-to-update ratio instead of the learning rate (``dp_noise_cause``)."""
    trained = [r for r in rows if (r.get("round") or 0) > 0]
    if not trained or num_classes < 2:
        return None
    last = trained[-1]
    for acc_key, loss_key in (("test-accuracy", "test-loss"), ("federated-accuracy", "federated-loss")):
        acc, loss = last.get(acc_key), last.get(loss_key)
        if acc is None or loss is None:
            continue
        per_class = last.get("per-class-accuracy") if acc_key == "test-accuracy" else None
        hits = [a for a in (per_class or []) if a and a > 0]
        # one class takes (almost) all the hits: it predicts one class for (almost) every input
        collapsed = per_class is not None and (not hits or max(hits) >= 0.8 * sum(hits))
        at_chance = acc <= 1.0 / num_classes + margin and loss >= 0.95 * math.log(num_classes)
        never_left = all((r.get(acc_key) or 0.0) <= 1.0 / num_classes + margin for r in trained)
        if not math.isfinite(loss) or (at_chance and collapsed):
            at = (f"the head round (round {last['round']})" if head_round_row(rows) is last
                  else f"round {last['round']}")
            dp = dp_noise_cause(privacy)
            if dp is not None and dp[0]:   # a DP run: the noise, measured against the update, not the learning rate
                return (f"the global model is dead after {at} ({acc_key} {acc:.4f}, {loss_key} "
                        f"{loss:.4g}, one class predicted for almost every input): the run trained itself to chance "
                        f"level; {dp[1]}")
            return (f"the global model is dead after {at} ({acc_key} {acc:.4f}, {loss_key} "
                    f"{loss:.4g}, one class predicted for almost every input): the run trained itself to chance level (a "
                    f"learning rate far too high is the usual cause: lower lr" + (f"; {dp[1]}" if dp else "") + ")" + (
                        "; it never rose above chance, which a learning rate too low for this many rounds also gives "
                        "(the model stays where it started: raise lr or num-server-rounds)"
                        if never_left and math.isfinite(loss) else ""))
        return None
    return None


def fusion_outcome(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's fusion outcome from the strategy's per-round history (dicts with ``round``, ``fallback``,
    ``skipped``): fallback count and rounds, and ``status`` ``"failed"`` with an ``error`` when there were
    aggregation rounds and none of them succeeded (each fell back or was skipped). Post-steps after the last round
    (entries with ``post-step``, e.g. the head round) are not aggregation rounds."""
    history = [h for h in history if not h.get("post-step")]
    fell_back = [h for h in history if h.get("fallback")]
    skipped = [h for h in history if h.get("skipped")]
    out: dict[str, Any] = {"status": "completed", "error": None, "fallbacks": len(fell_back),
                           "fallback-rounds": [int(h["round"]) for h in fell_back],
                           # rounds where the divergence guard used the average instead of the fused model
                           "guarded-rounds": [int(h["round"]) for h in history if h.get("guard")]}
    if history and len(fell_back) + len(skipped) == len(history):
        first = (fell_back or skipped)[0]
        why = f"fell back ({first['fallback']})" if fell_back else f"was skipped ({first['skipped']})"
        out["status"] = "failed"
        out["error"] = (f"fusion never succeeded: {len(fell_back)} of {len(history)} rounds fell back and "
                        f"{len(skipped)} were skipped; round {first['round']} {why}")
    return out


def head_round_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The head round's row (``fusion-info`` has ``head-round``; ``head-round=true``: the last row), else ``None``."""
    last = rows[-1] if rows else None
    info = (last or {}).get("fusion-info")
    return last if isinstance(info, dict) and "head-round" in info and last.get("round", 0) > 0 else None


def rounds_text(num_rounds: int, head_round: bool) -> str:
    """The run's steps as the console, the tables and the plots count them: ``"10 rounds + head round"`` (the head
    round is its own step after the training rounds, not an 11th round), ``"1 round"``."""
    return f"{num_rounds} round{'' if num_rounds == 1 else 's'}" + (" + head round" if head_round else "")


def integer_round_ticks(ax: Any) -> None:
    """Round numbers are integers: no 0.5 / 1.5 ticks on a plot of a few rounds."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _reasons(entries: list[Any]) -> str:
    """``rejected`` / ``failures`` entries (dicts with ``node-id`` and ``reason``) as one CSV cell."""
    parts = []
    for e in entries:
        if isinstance(e, dict):
            node = e.get("node-id", "?")
            pid = e.get("partition-id")
            where = f"node {node}" + (f" (partition {pid})" if pid is not None else "")
            parts.append(f"{where}: {e.get('reason', '')}".replace("\n", " "))
        else:
            parts.append(str(e))
    return " | ".join(parts)


# capacity tiers: the round's {tier: value} records -> rounds.csv columns tier-<t>-<name>
TIER_COLUMNS = {"tier-accuracy": "test-accuracy", "tier-val-accuracy": "val-accuracy", "tier-bytes-sent": "bytes-sent",
                "tier-clients": "clients", "tier-train-seconds": "train-seconds"}


def csv_row(row: dict[str, Any]) -> dict[str, Any]:
    """One ``rounds.csv`` row of a results row: its scalars, with the per-class accuracies, per-client
    accuracies, rejected replies and failures flattened (see the module docstring); other lists and dicts
    (``fusion-info``, ``client-partition-ids``) are left to ``results.json``."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k == "per-class-accuracy" and isinstance(v, (list, tuple)):
            out.update({f"class-{c}-accuracy": a for c, a in enumerate(v)})
        elif k == "client-test-accuracy" and isinstance(v, (list, tuple)):
            pids = row.get("client-partition-ids")
            ids = pids if isinstance(pids, (list, tuple)) and len(pids) == len(v) else range(len(v))
            out.update({f"client-{p}-test-accuracy": a for p, a in zip(ids, v)})
        elif k == "client-federated-accuracy" and isinstance(v, dict):   # evaluation='federated'/'both'
            out.update({f"client-{p}-federated-accuracy": a for p, a in v.items()})
        elif k in TIER_COLUMNS and isinstance(v, dict):   # capacity tiers: {tier: value}
            out.update({f"tier-{t}-{TIER_COLUMNS[k]}": a for t, a in v.items()})
        elif k in ("rejected", "failures") and isinstance(v, (list, tuple)):
            out[k] = len(v)
            out["rejected-reasons" if k == "rejected" else "failure-reasons"] = _reasons(list(v))
        elif not isinstance(v, (list, tuple, dict)):
            out[k] = v
    return out


class RunRecorder:
    """Collects per-round rows and writes ``results.json``, ``rounds.csv``, ``accuracy.png``."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any], *, write_config: bool = True):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        if write_config:
            _atomic_write(self.dir / "config.json", json.dumps(_jsonable(config), indent=2))

    def add_round(self, row: dict[str, Any]) -> None:
        self.rows = [r for r in self.rows if r.get("round") != row.get("round")] + [row]
        self.rows.sort(key=lambda r: r["round"])
        self.write()

    def write(self) -> None:
        payload = {"config": self.config, "rounds": self.rows, **self.extra}
        _atomic_write(self.dir / "results.json", json.dumps(_jsonable(payload), indent=2))
        flat = [csv_row(r) for r in self.rows]
        columns: list[str] = []
        for r, fr in zip(self.rows, flat):
            if r.get("round", 0) > 0 and "fallback" not in columns:  # always a column (empty = fused)
                columns.append("fallback")
            columns += [k for k in fr if k not in columns]
        tmp = self.dir / "rounds.csv.tmp"
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            for fr in flat:
                w.writerow({k: fr.get(k) for k in columns})
        os.replace(tmp, self.dir / "rounds.csv")

    def plot(self, title: str = "") -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        # evaluation='federated': no server test set; the clients' validation accuracy of the global model
        key = "test-accuracy" if any(r.get("test-accuracy") is not None for r in self.rows) else "federated-accuracy"
        head = head_round_row(self.rows)
        train = [r for r in self.rows if r is not head]
        ax.plot([r["round"] for r in train], [r.get(key) for r in train], "o-",
                label="global model" if key == "test-accuracy" else "global model (clients' validation splits)")
        if head is not None and isinstance(head.get(key), (int, float)):
            # the head round is its own step after the last training round: shaded, reached by a dotted segment, a star
            ax.axvspan(head["round"] - 0.5, head["round"] + 0.5, color="0.92", zorder=0)
            if train and isinstance(train[-1].get(key), (int, float)):
                ax.plot([train[-1]["round"], head["round"]], [train[-1][key], head[key]], ":", color="C0")
            ax.plot([head["round"]], [head[key]], "*", color="C0", markersize=15, markeredgecolor="black",
                    markeredgewidth=0.6, zorder=6, label="after the head round (classifier solved from the clients' "
                                                         "statistics)")
        tiers = sorted({t for r in self.rows for t in (r.get("tier-accuracy") or {}) if tier_sort_key(t) != (1, 1)},
                       key=tier_sort_key, reverse=True)
        for t in tiers:   # capacity tiers: every narrower tier's model (tier 1 is the global model)
            pts = [(r["round"], r["tier-accuracy"][t]) for r in self.rows if t in (r.get("tier-accuracy") or {})]
            ax.plot(*zip(*pts), ".-", label=f"tier {t} model")
        fed = [(r["round"], r["federated-accuracy"]) for r in self.rows
               if key == "test-accuracy" and r.get("federated-accuracy") is not None]
        if fed:
            ax.plot(*zip(*fed), "^:", label="global model, federated evaluation (clients' validation splits)")
        # the clients' ensemble of each training round (the head round trains no client: its row repeats the last)
        ens = [(r["round"], r["ensemble-accuracy"]) for r in train if r.get("ensemble-accuracy") is not None]
        if ens:
            ax.plot(*zip(*ens), "s--", label="ensemble of clients (reference)")
        fell_back = [(r["round"], r.get(key)) for r in self.rows if r.get("fallback")]
        if fell_back:
            ax.plot(*zip(*fell_back), "x", color="red", markersize=12, markeredgewidth=2.5,
                    label="fusion fell back", zorder=5)
        skipped = [(r["round"], r.get(key)) for r in self.rows if r.get("skipped")]
        if skipped:
            ax.plot(*zip(*skipped), "D", color="gray", fillstyle="none", markersize=10,
                    label="round skipped (too few valid replies)", zorder=5)
        guarded = [(r["round"], r.get(key)) for r in self.rows if r.get("guard")]
        if guarded:
            ax.plot(*zip(*guarded), "o", color="orange", fillstyle="none", markersize=12, markeredgewidth=2,
                    label="guarded (weighted average used)", zorder=5)
        for i, (label, acc) in enumerate(self._reference_lines()):  # one-shot references: horizontal lines
            ax.axhline(acc, ls=("--", ":", "-.")[i % 3], color=f"C{(i + 2) % 10}", lw=1.1, label=f"{label}: {acc:.3f}")
        integer_round_ticks(ax)
        if head is not None:   # the head round's tick says so
            fig.canvas.draw()
            lo, hi = ax.get_xlim()
            ticks = [int(t) for t in ax.get_xticks() if lo <= t <= hi and t < head["round"]] + [head["round"]]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks[:-1]] + ["head\nround"])
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy" if key == "test-accuracy" else "federated (validation) accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if self._reference_lines() or head is not None else None)
        ax.set_title(title)
        path = self.dir / "accuracy.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def _reference_lines(self) -> list[tuple[str, float]]:
        """``[(label, accuracy)]`` of the one-shot references in ``extra`` (``fedfuse.references``), else ``[]``."""
        rows = (self.extra.get("one-shot-references") or {}).get("rows", [])
        return [(REFERENCE_LABELS.get(r["key"], r["key"]), float(r["accuracy"])) for r in rows
                if isinstance(r.get("accuracy"), (int, float))]

    def save_model(self, state: dict[str, torch.Tensor], name: str = "global_model.pt") -> Path:
        path = self.dir / name
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path


# ------------------------------------------------------------------ checkpoint and resume
CHECKPOINT_DIR = "checkpoint"


def save_checkpoint(out_dir: str | Path, server_round: int, state: dict[str, torch.Tensor],
                    run_state: dict[str, Any]) -> Path:
    """Write ``<out_dir>/checkpoint/{global_model.pt,state.json}`` for a completed round, atomically.

    Each file is written to a temporary name and renamed. The model is written first and the previous
    one kept as ``global_model.prev.pt``; ``state.json`` (written last) is the commit record, and
    ``load_checkpoint`` picks whichever model file carries its round, so a crash between the renames
    never leaves a state that points at the wrong model.
    """
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    ckpt.mkdir(parents=True, exist_ok=True)
    model, prev = ckpt / "global_model.pt", ckpt / "global_model.prev.pt"
    tmp = ckpt / "global_model.pt.tmp"
    torch.save({"round": int(server_round), "state_dict": {k: v.detach().cpu() for k, v in state.items()}}, tmp)
    if model.exists():
        os.replace(model, prev)
    os.replace(tmp, model)
    _atomic_write(ckpt / "state.json", json.dumps(_jsonable({**run_state, "round": int(server_round)}), indent=1))
    return ckpt


def load_checkpoint(out_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(run_state, global state dict)`` of the last completed round, or ``None`` without a checkpoint."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    if not (ckpt / "state.json").exists():
        return None
    run_state = json.loads((ckpt / "state.json").read_text())
    for name in ("global_model.pt", "global_model.prev.pt"):
        path = ckpt / name
        if path.exists():
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if int(obj["round"]) == int(run_state["round"]):
                return run_state, obj["state_dict"]
    raise RuntimeError(f"checkpoint {ckpt}: no global model file for round {run_state['round']}")


# ------------------------------------------------------------------ a run's folder: fresh start, interruption
# what a run writes in its folder (the ServerApp's files, the runner's comparison): a fresh run (resume=false)
# removes a previous run's before it starts, so that nothing the runner reads back or the user finds there is another
# run's (issue 60 item 2); run.log is the runner's own (truncated by it), other folders (baseline-*, warm-start) stay
RUN_FILES = ("results.json", "rounds.csv", "config.json", "accuracy.png", "global_model.pt", "DONE",
             "comparison.md", "comparison.png")


def clear_run_results(out_dir: str | Path) -> list[str]:
    """Remove a previous run's results and checkpoint from ``out_dir`` (``RUN_FILES``, ``tier-*_model.pt``,
    ``checkpoint/``) before a fresh run writes there; the names removed."""
    out = Path(out_dir)
    removed = []
    for path in [out / name for name in RUN_FILES] + sorted(out.glob("tier-*_model.pt")):
        if path.is_file():
            path.unlink()
            removed.append(path.name)
    ckpt = out / CHECKPOINT_DIR
    if ckpt.is_dir():
        for path in ckpt.iterdir():
            if path.is_file():
                path.unlink()
        ckpt.rmdir()
        removed.append(CHECKPOINT_DIR + "/")
    return removed


def last_completed_round(out_dir: str | Path) -> int:
    """The last round ``out_dir``'s checkpoint holds (what ``resume=true`` continues from), 0 without one."""
    state = Path(out_dir) / CHECKPOINT_DIR / "state.json"
    try:
        return int(json.loads(state.read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def mark_interrupted(out_dir: str | Path, signal_name: str) -> int:
    """Record in ``out_dir``'s ``results.json`` (and ``rounds.csv``) that the run was interrupted by
    ``signal_name``: ``"status": "interrupted"`` and ``"interrupted": {"signal", "after-round", "at", "resume"}``,
    its rows those of the rounds up to its last completed round (the checkpoint's, which ``resume=true`` continues
    from). Call it once every process of the run has stopped. Returns that round."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    last = last_completed_round(out)
    res = out / "results.json"
    payload: dict[str, Any] = {}
    if res.is_file():
        try:
            payload = json.loads(res.read_text())
        except ValueError:   # not possible with the atomic writes; a hand-edited file is kept aside, said
            res.replace(out / "results.unreadable.json")
    if not payload and (out / "config.json").is_file():
        payload = {"config": json.loads((out / "config.json").read_text())}
    config = payload.pop("config", {})
    rows = [r for r in payload.pop("rounds", []) if isinstance(r, dict) and int(r.get("round", 0)) <= last]
    payload.update({"status": "interrupted", "error": None, "interrupted": {
        "signal": signal_name, "after-round": last, "at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "resume": f"the same run with resume=true (same output-dir and run-name) continues after round {last}"}})
    recorder = RunRecorder(out, config, write_config=False)
    recorder.rows, recorder.extra = rows, payload
    recorder.write()
    done = out / "DONE"
    if done.exists():
        done.unlink()
    return last
