"""Misuse on the deployment path (issue 60): what a node or a user does by accident to a real SuperLink + SuperNodes
federation on loopback, and what fedfuse does about it.

Each case runs a real deployment (``simulations.runners.deployment.Deployment``: ``flower-superlink`` with TLS and
SuperNode authentication unless the case says otherwise, ``flower-supernode`` processes, ``flwr run``) of a small
federation (digits, MLP 16 wide, 3 nodes, 2 rounds of kf-linear) with one thing going wrong, and records what
happened: the run's status, what the server logged about it, what ``results.json`` says (valid replies, rejected
replies with their reasons, failures, the final accuracy). Client faults come from the TEST-ONLY fault app
(``tests/support/faults.py``: ``test-faults`` in the run config, ``fault`` in a node config).

    .venv/bin/python -m simulations.bench.deploy_misuse --out results/deploy-misuse            # every case
    .venv/bin/python -m simulations.bench.deploy_misuse --cases nan,crash --out /tmp/misuse    # some

Writes ``cases.json`` (one record per case, written as each finishes) and ``cases.md`` (the table quoted in
docs/trust.md). ``expected`` is what a user should get; ``as-expected`` is checked from the records, not judged by
hand.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulations.runners.deployment import CONNECTION, Deployment, _bin
from tests.support.fault_app import write_fault_app

BASE = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "partitioning": "shards",
        "num-server-rounds": 2, "local-epochs": 2, "fusion-set-size": 100, "strategy": "kf-linear",
        "importance": "deeplift", "importance-samples": 64, "head-round": False, "num-clients": 3,
        "min-train-nodes": 2, "round-timeout": 90}

CASES: dict[str, dict[str, Any]] = {}


def case(name: str, session: str, what: str, expected: str):
    def deco(fn: Callable[..., dict]) -> Callable[..., dict]:
        CASES[name] = {"fn": fn, "session": session, "what": what, "expected": expected}
        return fn
    return deco


# ------------------------------------------------------------------------------------------------ reading a run
def results_of(out_dir: Path) -> dict[str, Any]:
    """What ``results.json`` says about the run, in brief (``{}`` when there is none)."""
    path = Path(out_dir) / "results.json"
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    rounds = [r for r in res.get("rounds", []) if r.get("round", 0) > 0]
    brief = {"status": res.get("status"), "rounds": len(rounds)}
    if rounds:
        brief["final-accuracy"] = rounds[-1].get("test-accuracy")
        brief["valid-replies"] = [r.get("valid-replies") for r in rounds]
        brief["rejected"] = [[{"partition-id": x.get("partition-id"), "reason": str(x.get("reason", ""))[:160]}
                              for x in (r.get("rejected") or [])] for r in rounds]
        brief["failures"] = [[{"partition-id": x.get("partition-id"), "reason": str(x.get("reason", ""))[:160]}
                              for x in (r.get("failures") or [])] for r in rounds]
        brief["fallback"] = [r.get("fallback") for r in rounds]
    return brief


def lines(text: str, pattern: str, limit: int = 4) -> list[str]:
    """The log lines matching ``pattern`` (case-insensitive), ANSI codes removed, at most ``limit``."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    hits = [ln.strip()[:240] for ln in text.splitlines() if re.search(pattern, ln, re.I)]
    return hits[:limit]


def outcome_record(outcome) -> dict[str, Any]:
    return {"status": outcome.status, "details": str(outcome.details)[:300], "results": results_of(outcome.out_dir),
            "log": lines(outcome.log, r"reject|WARNING|ERROR|fail|diverg|non-finite")}


def wait_for_checkpoint(run_dir: Path, timeout: float = 360.0) -> None:
    """Wait (bounded) until the run in ``run_dir`` has checkpointed its first round."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoint" / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)


def cfg(out: Path, name: str, **kw) -> dict[str, Any]:
    return {**BASE, "output-dir": str(out), "run-name": name, **kw}


def rejected_partitions(rec: dict, rnd: int = 0) -> set:
    rej = rec["results"].get("rejected") or [[]]
    return {x["partition-id"] for x in rej[rnd]} if len(rej) > rnd else set()


def failed_partitions(rec: dict, rnd: int = 0) -> set:
    fails = rec["results"].get("failures") or [[]]
    return {x["partition-id"] for x in fails[rnd]} if len(fails) > rnd else set()


def completed_with(rec: dict, valid_round1: int) -> bool:
    r = rec["results"]
    return rec["status"] == "finished:completed" and r.get("rounds") == 2 and (r.get("valid-replies") or [0])[0] == valid_round1


# ------------------------------------------------------------------------------------- session: reply faults
def _fault_case(name: str, fault: str, expected: str, what: str, check: Callable[[dict], bool]):
    @case(name, "faults", what, expected)
    def run(dep: Deployment, out: Path) -> dict:
        rec = outcome_record(dep.run(cfg(out, name, **{"test-faults": fault}), timeout=420))
        rec["as-expected"] = bool(check(rec))
        return rec
    return run


_fault_case("reference", "", "completes, 3 valid replies a round", "no fault (the reference run)",
            lambda r: completed_with(r, 3))
for _name, _fault, _what in (
        ("nan", "1:nan@1", "node 1 sends a NaN weight in round 1"),
        ("scale", "1:scale:1e20@1", "node 1 sends finite weights x 1e20 in round 1"),
        ("shape", "1:shape@1", "node 1 sends a weight of the wrong shape in round 1"),
        ("neg-scores", "1:neg-scores@1", "node 1 sends negative importance scores in round 1"),
        ("no-scores", "1:no-scores@1", "node 1 sends no importance scores though asked, round 1"),
        ("short-scores", "1:short-scores@1", "node 1 sends importance scores one short, round 1")):
    _fault_case(_name, _fault, "node 1's reply rejected with a reason naming it; the round aggregates the 2 others; "
                "the run completes", _what,
                lambda r: completed_with(r, 2) and rejected_partitions(r) == {1})
_fault_case("dtype", "1:dtype@1", "accepted (float64 is cast to the model's float32) or rejected with a reason; "
            "the run completes", "node 1 sends float64 weights in round 1",
            lambda r: r["status"] == "finished:completed" and (r["results"].get("valid-replies") or [0])[0] in (2, 3))
_fault_case("num-examples", "1:num-examples@1", "node 1's absurd sample count capped or its reply rejected with a "
            "reason; the run completes", "node 1 claims 10^12 training samples",
            lambda r: completed_with(r, 2) and rejected_partitions(r) == {1})
_fault_case("crash", "1:crash@1", "node 1's failure recorded with its reason; the round aggregates the 2 others",
            "node 1's ClientApp raises in round 1",
            lambda r: completed_with(r, 2) and failed_partitions(r) == {1})
_fault_case("exit", "1:exit@1", "node 1's failure recorded; the round aggregates the 2 others (the SuperNode "
            "starts a new ClientApp process for round 2)", "node 1's ClientApp process dies (os._exit) in round 1",
            lambda r: completed_with(r, 2) and 1 in failed_partitions(r))
_fault_case("oversized", "1:pad:300@1", "node 1's reply (300 MB of extra weights) rejected with a reason; the round "
            "aggregates the 2 others", "node 1 sends a reply with a 300 MB weight the model does not have",
            lambda r: completed_with(r, 2) and rejected_partitions(r) == {1})
_fault_case("all-nan", "*:nan@1", "every reply rejected: the run fails loudly saying so (no 'completed' run with an "
            "untrained model)", "every node sends NaN weights in round 1",
            lambda r: r["status"] != "finished:completed" or (r["results"].get("valid-replies") or [1])[0] == 0
            and any("reject" in ln.lower() for ln in r["log"]))


@case("node-restart", "faults", "SuperNode 1 is killed (SIGKILL) mid-round 2 and restarted at once",
      "round 2 records node 1's failure (timeout) and aggregates the others; the run completes")
def node_restart(dep: Deployment, out: Path) -> dict:
    c = cfg(out, "node-restart", **{"test-faults": "1:sleep:30@2", "round-timeout": 60})
    dep.wait_for_nodes()
    run_id = dep.submit(c)
    wait_for_checkpoint(out / "node-restart")
    time.sleep(5)   # round 2's messages delivered: node 1 sleeps inside its ClientApp
    dep.kill_supernode(1)
    dep.supernodes[1] = dep.start_supernode(1)
    status, details = dep.wait(run_id, timeout=420)
    rec = {"status": status, "details": details[:300], "results": results_of(out / "node-restart"),
           "log": lines(dep.logs_of(run_id), r"reject|WARNING|ERROR|fail|no reply")}
    vr = rec["results"].get("valid-replies") or []
    rec["as-expected"] = status == "finished:completed" and len(vr) == 2 and vr[1] == 2
    return rec


@case("same-run-name", "faults", "two runs submitted at once with the same output-dir and run-name",
      "one run owns the folder; the other fails naming run-name (or writes its own folder); neither prints the "
      "other's numbers")
def same_run_name(dep: Deployment, out: Path) -> dict:
    dep.wait_for_nodes()
    a = dep.submit(cfg(out, "twin", seed=0))
    b = dep.submit(cfg(out, "twin", seed=1))
    sa, da = dep.wait(a, timeout=600)
    sb, db = dep.wait(b, timeout=600)
    la, lb = dep.logs_of(a), dep.logs_of(b)
    folders = sorted(p.name for p in out.iterdir() if p.name.startswith("twin"))
    res = results_of(out / "twin")
    rec = {"status": f"A {sa}, B {sb}", "details": f"A: {da[:120]} | B: {db[:120]}", "results": res,
           "folders": folders, "log": lines(la + "\n" + lb, r"run-name|lock|owned|another run|ERROR")}
    seeds = set()
    for f in folders:
        p = out / f / "config.json"
        if p.exists():
            conf = json.loads(p.read_text())
            seeds.add(conf.get("seed", conf.get("run-config", {}).get("seed")))
    rec["seeds-in-folders"] = sorted(s for s in seeds if s is not None)
    one_failed_naming = ("failed" in sa) != ("failed" in sb) and any("run-name" in ln for ln in rec["log"])
    rec["as-expected"] = bool(one_failed_naming or (len(folders) == 2 and len(rec["seeds-in-folders"]) == 2))
    return rec


@case("flwr-stop", "faults", "the user stops the run mid-round 2 with `flwr stop <run-id>`",
      "the run ends 'stopped'; results.json says so at its last completed round, and resume=true continues it")
def flwr_stop(dep: Deployment, out: Path) -> dict:
    c = cfg(out, "stopped", **{"test-faults": "*:sleep:20@2"})
    dep.wait_for_nodes()
    run_id = dep.submit(c)
    wait_for_checkpoint(out / "stopped")
    time.sleep(3)
    stop = dep.flwr("stop", str(run_id), CONNECTION, timeout=90)
    status, details = dep.wait(run_id, timeout=120)
    rec = {"status": status, "details": details[:300], "stop-cli": (stop.stdout + stop.stderr)[-300:],
           "results": results_of(out / "stopped")}
    resumed = dep.run(cfg(out, "stopped", resume=True), timeout=420)
    rec["resume"] = outcome_record(resumed)
    rec["as-expected"] = ("stopped" in status and rec["results"].get("status") not in (None, "running")
                          and resumed.ok and rec["resume"]["results"].get("rounds") == 2)
    return rec


@case("fusion-set-replaced", "faults", "the fusion-set file is overwritten (another seed's draw) between round 1 "
      "and round 2, then the run is resumed with resume=true",
      "the running server keeps the set it read; results.json records which file content it used, and a resume with "
      "different content says so")
def fusion_set_replaced(dep: Deployment, out: Path) -> dict:
    from fedfuse.data import write_fusion_set_file

    path = out / "fusion.npz"
    write_fusion_set_file(str(path), dataset="digits", size=100, seed=0)
    c = cfg(out, "fs-replaced", **{"fusion-set-path": str(path), "test-faults": "*:sleep:10@2"})
    dep.wait_for_nodes()
    run_id = dep.submit(c)
    wait_for_checkpoint(out / "fs-replaced")
    write_fusion_set_file(str(path), dataset="digits", size=100, seed=7)
    status, details = dep.wait(run_id, timeout=420)
    log = dep.logs_of(run_id)
    res_path = out / "fs-replaced" / "results.json"
    text = res_path.read_text() if res_path.exists() else ""
    rec = {"status": status, "details": details[:300], "results": results_of(out / "fs-replaced"),
           "log": lines(log, r"fusion.set|fusion-set|changed|hash|sha")}
    rec["records-content-hash"] = bool(re.search(r"sha256|fusion-set-hash|digest", text))
    rec["as-expected"] = status == "finished:completed" and rec["records-content-hash"]
    return rec


@case("min-train-nodes", "faults", "min-train-nodes=5 with 3 SuperNodes (num-clients=3), the runner's check skipped",
      "the ServerApp fails at once naming strategy-options.min-train-nodes (no endless wait)")
def too_many_nodes(dep: Deployment, out: Path) -> dict:
    t0 = time.monotonic()
    o = dep.run(cfg(out, "min5", **{"min-train-nodes": 5}), timeout=240, check_config=False)
    rec = outcome_record(o)
    rec["seconds-to-end"] = round(time.monotonic() - t0)
    rec["log"] = lines(o.log, r"min-train-nodes|min_train|error", 3)
    rec["as-expected"] = o.status == "finished:failed" and any("min-train-nodes" in ln for ln in rec["log"])
    return rec


def _plain_flwr_run(dep: Deployment, text: str) -> subprocess.CompletedProcess:
    return dep.flwr("run", str(dep.app_dir), CONNECTION, "--run-config", text, "--format", "json", timeout=120)


@case("flat-key", "faults", "plain `flwr run` with a former flat spelling (`min-train-nodes=2`, now "
      "`strategy-options.min-train-nodes`)", "refused before the run starts, naming the key")
def flat_key(dep: Deployment, out: Path) -> dict:
    res = _plain_flwr_run(dep, f"min-train-nodes=2 output-dir='{out}' run-name='flat'")
    text = res.stdout + res.stderr
    return {"status": f"flwr run rc {res.returncode}", "details": text[-300:], "results": results_of(out / "flat"),
            "as-expected": "min-train-nodes" in text and not (out / "flat").exists()}


@case("dotted-typo", "faults", "plain `flwr run` with a misspelled option-table key (`strategy-options.min-train-node=2`)",
      "refused before the run starts, naming the key")
def dotted_typo(dep: Deployment, out: Path) -> dict:
    res = _plain_flwr_run(dep, f"strategy-options.min-train-node=2 output-dir='{out}' run-name='typo'")
    text = res.stdout + res.stderr
    return {"status": f"flwr run rc {res.returncode}", "details": text[-300:], "results": results_of(out / "typo"),
            "as-expected": "min-train-node" in text and not (out / "typo").exists()}


# ------------------------------------------------------------------------------------- session: rogue nodes
def _rogue(dep: Deployment, name: str, extra: list[str], node_config: str) -> subprocess.Popen:
    from fedfuse.flower.runner.flwr_runner import free_port

    cmd = [_bin("flower-supernode"), "--superlink", dep.address, "--port", str(free_port()),
           "--node-config", node_config, *extra]
    return dep._spawn(name, cmd)


def _rogue_case(dep: Deployment, out: Path, name: str, extra: list[str], node_config: str, expect_online: bool,
                log_pattern: str) -> dict:
    proc = _rogue(dep, name, extra, node_config)
    dep.supernodes.append(proc)   # stopped with the deployment
    time.sleep(20)
    o = dep.run(cfg(out, name, **{"num-clients": 2, "min-train-nodes": 2}), timeout=420)
    rec = outcome_record(o)
    rec["rogue-log"] = lines(dep.log_tail(name, 10**6), log_pattern, 3)
    rec["rogue-alive"] = proc.poll() is None
    nodes = json.loads(dep.flwr("supernode", "list", CONNECTION, "--format", "json").stdout or "{}").get("nodes", [])
    rec["online-nodes"] = sum(str(n.get("status", "")).lower() == "online" for n in nodes)
    dep._kill(proc)
    rec["as-expected"] = bool(o.ok and rec["results"].get("rounds") == 2 and rec["rogue-log"]
                              and (rec["online-nodes"] >= 3) == expect_online)
    return rec


@case("unregistered-key", "nodes", "a SuperNode with a key pair that was never registered (`flwr supernode register`)",
      "the SuperLink refuses it (its log says why); the run of the 2 registered nodes completes")
def unregistered(dep: Deployment, out: Path) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
    from gen_node_keys import generate as gen_keys

    (priv, _), = gen_keys(out / "rogue-keys", 1)
    return _rogue_case(dep, out, "unregistered-key", ["--root-certificates", str(dep.certs["ca"]),
                                                      "--auth-supernode-private-key", str(priv)],
                       "partition-id=0 num-partitions=2", False, r"auth|denied|unauthen|permission|error")


@case("insecure-node", "nodes", "a SuperNode started with --insecure against the TLS SuperLink",
      "it cannot connect (its log says so); the run of the 2 good nodes completes")
def insecure_node(dep: Deployment, out: Path) -> dict:
    return _rogue_case(dep, out, "insecure-node", ["--insecure"], "partition-id=0 num-partitions=2", False,
                       r"error|unavailable|connect|ssl|tls|handshake")


@case("wrong-ca", "nodes", "a SuperNode given another CA's certificate as --root-certificates",
      "the TLS handshake fails (its log says so); the run of the 2 good nodes completes")
def wrong_ca(dep: Deployment, out: Path) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
    from gen_certs import generate

    other = generate(out / "other-certs")
    return _rogue_case(dep, out, "wrong-ca", ["--root-certificates", str(other["ca"])],
                       "partition-id=0 num-partitions=2", False, r"error|ssl|certificate|handshake|unavailable")


# ------------------------------------------------------------------------------------- session: node data
def _node_case(name: str, node_configs: list[dict], what: str, expected: str, reason_word: str) -> None:
    @case(name, "data", what, expected)
    def run(dep: Deployment, out: Path) -> dict:
        rec = outcome_record(dep.run(cfg(out, name, **{"num-clients": 3, "min-train-nodes": 2}), timeout=420))
        reasons = [f["reason"] for rnd in rec["results"].get("failures") or [] for f in rnd]
        rec["as-expected"] = (rec["status"] == "finished:completed" and any(reason_word in r for r in reasons)
                              and (rec["results"].get("valid-replies") or [0])[0] == 2)
        return rec
    run.node_configs = node_configs


_node_case("node-missing-data", [{}, {"data-path": "/nonexistent/fedfuse/node1.npz"}, {}],
           "SuperNode 1's node-config data-path names a file that does not exist",
           "node 1's failure recorded with a reason naming data-path; the others' rounds complete", "data-path")
_node_case("node-wrong-partitions", [{}, {}, {"num-partitions": 5}],
           "SuperNode 2's node-config says num-partitions=5 in a 3-client federation",
           "node 2's failure recorded with a reason naming num-partitions / num-clients; the others' rounds complete",
           "partition")


# ------------------------------------------------------------------------------------- session: the server's disk
@case("disk-full", "disk", "the output-dir is a 96 KiB tmpfs: the disk fills while the server checkpoints",
      "the run fails with one line naming the folder and 'No space left'; the last complete checkpoint stays "
      "readable")
def disk_full(dep: Deployment, out: Path) -> dict:
    mnt = out / "tiny"
    mnt.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return {"status": "not run", "details": f"mount tmpfs: {mounted.stderr.strip()}", "results": {},
                "as-expected": None}
    try:
        # 256 hidden units: a checkpoint of ~80 KB fits once, not twice (the previous one is kept while the next is
        # written), so the disk fills at round 2's checkpoint
        o = dep.run({**cfg(mnt, "full"), "num-clients": 2, "min-train-nodes": 2, "model-width": 256}, timeout=420)
        rec = outcome_record(o)
        rec["log"] = lines(o.log, r"space|ENOSPC|checkpoint|Errno|ERROR", 4)
        from fedfuse.results import load_checkpoint

        try:
            state = load_checkpoint(mnt / "full")
            rec["checkpoint-readable"] = None if state is None else int(state[0].get("round", -1))
        except Exception as exc:   # noqa: BLE001 - recorded
            rec["checkpoint-readable"] = f"{type(exc).__name__}: {exc}"[:200]
        rec["files"] = sorted(p.name for p in (mnt / "full").rglob("*"))[:20] if (mnt / "full").exists() else []
        rec["as-expected"] = (o.status == "finished:failed" and any("space" in ln.lower() for ln in rec["log"])
                              and not isinstance(rec["checkpoint-readable"], str))
        return rec
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@case("superlink-killed", "disk", "the SuperLink (and its ServerApp) is killed after round 1; a new SuperLink and "
      "nodes are started and the run is submitted again with resume=true",
      "the second run continues at round 2 from the checkpoint and completes")
def superlink_killed(dep: Deployment, out: Path) -> dict:
    c = {**cfg(out, "killed", **{"test-faults": "*:sleep:20@2"}), "num-clients": 2, "min-train-nodes": 2}
    dep.wait_for_nodes()
    run_id = dep.submit(c)
    wait_for_checkpoint(out / "killed")
    dep._kill(dep.superlink)   # the server machine goes down first (SuperLink and its ServerApp, by PID) ...
    dep.stop()                 # ... then the SuperNodes lose it
    first = results_of(out / "killed")
    with Deployment(2, tls=dep.tls, auth=dep.auth, app_dir=dep.app_dir) as again:
        o = again.run({**c, "resume": True, "test-faults": ""}, timeout=420)
        rec = outcome_record(o)
    rec["after-kill"] = first
    rec["submitted-run"] = run_id
    rec["as-expected"] = o.ok and rec["results"].get("rounds") == 2
    return rec


SESSIONS: dict[str, dict[str, Any]] = {
    "faults": dict(num_supernodes=3, tls=True, auth=True),
    "nodes": dict(num_supernodes=2, tls=True, auth=True),
    "data": dict(num_supernodes=3, tls=True, auth=True),
    "disk": dict(num_supernodes=2, tls=True, auth=True),
}




def md_table(records: list[dict]) -> str:
    out = ["| # | case | what happens | expected | what fedfuse did | as expected |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(records, 1):
        res = r.get("results") or {}
        did = [r.get("status", "")]
        if res:
            final = res.get("final-accuracy")
            did.append(f"rounds {res.get('rounds')}, valid replies {res.get('valid-replies')}, final "
                       f"{'-' if final is None else f'{final:.4f}'}, results.json status {res.get('status')}")
            rej = [x for rnd in res.get("rejected") or [] for x in rnd]
            fail = [x for rnd in res.get("failures") or [] for x in rnd]
            if rej:
                did.append("rejected: " + "; ".join(f"p{x['partition-id']}: {x['reason'][:90]}" for x in rej[:2]))
            if fail:
                did.append("failed: " + "; ".join(f"p{x['partition-id']}: {x['reason'][:90]}" for x in fail[:2]))
        if not res and r.get("details"):
            did.append(re.sub(r"\s+", " ", str(r["details"]))[-160:])
        for key in ("rogue-log", "log"):
            if r.get(key) and not res:
                did.append(r[key][0][:160])
        if r.get("error"):
            did.append("study error: " + r["error"][:160])
        exp = {True: "yes", False: "**no**", None: "not run"}[r.get("as-expected")]
        cell = "<br>".join(str(d).replace("|", "/") for d in did if d)
        out.append(f"| {i} | `{r['case']}` | {r['what']} | {r['expected']} | {cell} | {exp} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--out", default="results/deploy-misuse")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cases.json"
    records = [r for r in (json.loads(path.read_text()) if path.exists() else []) if r["case"] not in names]
    work = Path(tempfile.mkdtemp(prefix="fedfuse-misuse-"))
    app = write_fault_app(work / "app")
    for session in SESSIONS:
        todo = [c for c in names if CASES[c]["session"] == session]
        if not todo:
            continue
        spec = SESSIONS[session]
        for name in todo:   # a fresh deployment per case: one case's leftovers never explain another's result
            c = CASES[name]
            t0 = time.monotonic()
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {c['what']}", flush=True)
            rec: dict[str, Any] = {"case": name, "session": session, "what": c["what"], "expected": c["expected"]}
            try:
                with Deployment(spec["num_supernodes"], tls=spec["tls"], auth=spec["auth"], app_dir=app,
                                node_configs=getattr(c["fn"], "node_configs", None)) as dep:
                    rec.update(c["fn"](dep, work / name))
            except Exception as exc:   # noqa: BLE001 - a study error is recorded, the other cases go on
                rec.update({"status": "study error", "error": f"{type(exc).__name__}: {exc}"[:400],
                            "trace": traceback.format_exc()[-1500:], "as-expected": False, "results": {}})
            rec["wall-seconds"] = round(time.monotonic() - t0)
            print(f"    -> {rec.get('status')} as-expected={rec.get('as-expected')}", flush=True)
            records = [r for r in records if r["case"] != name] + [rec]
            order = list(CASES)
            records.sort(key=lambda r: order.index(r["case"]) if r["case"] in order else 99)
            path.write_text(json.dumps(records, indent=1, default=str) + "\n")
            (out / "cases.md").write_text(md_table(records))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {path} and {out / 'cases.md'}")


if __name__ == "__main__":
    main()
