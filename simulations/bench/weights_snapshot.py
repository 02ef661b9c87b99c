"""Hash the final global weights of default-option runs (in-process engine): a refactor must leave them bit-identical.

    python -m simulations.bench.weights_snapshot before.json            # on the old commit
    python -m simulations.bench.weights_snapshot after.json             # on the new one; compare the two files
    python -m simulations.bench.weights_snapshot out.json default ot    # only some cases
"""
import hashlib, json, sys, os

import torch
from fedfuse.flower.runner.inprocess import run_inprocess

BASE = {"num-server-rounds": 3, "output-dir": "/tmp/snapruns"}
CASES = {
  "default": {},
  "default-10r": {"num-server-rounds": 10},
  "fedavg": {"strategy": "fedavg"},
  "fedavgm": {"strategy": "fedavgm"},
  "fedprox": {"strategy": "fedprox", "proximal-mu": 0.01},
  "fedadam": {"strategy": "fedadam"},
  "kf-linear": {"strategy": "kf-linear"},
  "kf-gradient": {"strategy": "kf-gradient"},
  "ot": {"strategy": "ot"},
  "feddf": {"strategy": "feddf"},
  "kd": {"strategy": "kd"},
  "rebasin": {"strategy": "rebasin"},
  "average-mnist1d": {"dataset": "mnist1d", "partitioning": "dirichlet", "dirichlet-alpha": 0.1, "num-clients": 10, "min-train-nodes": 10},
  "tiers-average": {"client-tiers": "1,0.5,0.25"},
  "tiers-kf-linear": {"strategy": "kf-linear", "client-tiers": "1,0.5"},
  "heterofl": {"strategy": "heterofl", "client-tiers": "1,0.5,0.25"},
  "fedrolex": {"strategy": "fedrolex", "client-tiers": "1,0.5,0.25"},
  "one-shot": {"mode": "one-shot", "num-server-rounds": 1, "local-epochs": 3, "strategy": "kf-linear", "fusion-set-source": "client0"},
  "fusion-rounds": {"strategy": "kf-linear", "fusion-rounds": 1},
  "auto-sgd": {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05},
  "robust": {"strategy": "average", "robust": True},
  "depth-tiers": {"client-tiers": "1x1,1x0.5,0.5x0.5", "num-clients": 6},
  "depthfl": {"strategy": "depthfl", "client-tiers": "1x1,1x0.5", "num-clients": 4},
  "no-head": {"head-round": False},
  "refine-distill": {"strategy": "average", "refine": "calibrate+distill", "head-round": False},
}
only = sys.argv[2:] or list(CASES)
out = {}
for name in only:
    cfg = {**BASE, **CASES[name], "run-name": f"snap-{name}"}
    try:
        d = run_inprocess(cfg, echo=False)
        sd = torch.load(d / "global_model.pt", map_location="cpu", weights_only=True)
        h = hashlib.sha256()
        for k in sorted(sd):
            h.update(k.encode()); h.update(sd[k].cpu().contiguous().numpy().tobytes())
        res = json.loads((d / "results.json").read_text())
        accs = [r.get("test-accuracy") for r in res["rounds"]]
        tier = res["rounds"][-1].get("tier-accuracy")
        out[name] = {"sha": h.hexdigest()[:16], "acc": accs, "tier": tier}
    except Exception as e:
        out[name] = {"error": repr(e)[:300]}
    print(name, out[name], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
