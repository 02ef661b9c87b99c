"""The example's ServerApp: Flower's ``strategy.start`` with a fedfuse strategy and non-default record keys.

The strategy is a Flower ``FedAvg`` subclass: sampling, ``start``, ``evaluate_fn`` and ``Result`` are
Flower's; the aggregation fuses the validated replies on the server's unlabeled fusion set.
"""

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedfuse.flower import build_strategy
from own_app.task import Net, accuracy, initial_model, server_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-clients"])
    fusion_x, test_x, test_y = server_data(int(cfg["fusion-set-size"]))
    strategy = build_strategy(str(cfg["strategy"]), model_fn=Net, fusion_inputs=fusion_x,
                              fraction_train=1.0, min_train_nodes=n, min_available_nodes=n,
                              arrayrecord_key="weights", weighted_by_key="num-train")   # the client mirrors these

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"test-accuracy": accuracy(model, test_x, test_y)})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_model().state_dict()),
                            num_rounds=int(cfg["num-server-rounds"]), train_config=ConfigRecord({}),
                            evaluate_fn=evaluate)
    rows = [{"round": r, "test-accuracy": float(m["test-accuracy"])}
            for r, m in sorted(result.evaluate_metrics_serverapp.items())]
    history = [{k: h[k] for k in ("round", "method", "valid", "rejected", "fallback")} for h in strategy.history]
    out = Path(str(cfg["output-dir"]) or "results") / str(cfg["run-name"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rounds": rows, "strategy-history": history,
                                                  "train-metrics": {r: dict(m) for r, m in
                                                                    result.train_metrics_clientapp.items()}},
                                                 indent=1, default=str))
    print(f"own-flower-app: test accuracy per round {[round(r['test-accuracy'], 3) for r in rows]}; results in {out}")
    print("own-flower-app: a plain `flwr run` (local simulation) leaves Flower's local SuperLink and its SuperExec "
          "running for the next run; `fedfuse stop-superlink` stops them (examples/own-flower-app/README.md)")
