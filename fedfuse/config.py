"""Run configuration: every key of ``[tool.flwr.app.config]`` / ``--run-config`` is declared here.

``parse_run_config`` fails fast on unknown keys, wrong types and bad values, naming the key, before
any client work starts. Both the ServerApp and the ClientApp parse the same run config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

MODES = ("multi-round", "one-shot")
DATASETS = ("digits", "digits-flat", "mnist1d", "mnist1d-flat", "synthetic", "cifar10", "cifar100", "mnist",
            "fashion-mnist")
MODELS = ("mlp", "cnn", "resnet", "vit")
PARTITIONINGS = ("iid", "dirichlet", "shards", "full")
OPTIMIZERS = ("adam", "adamw", "sgd")
IMPORTANCE = ("uniform", "conductance", "deeplift")
FUSION_SOURCES = ("public", "client0")
FALLBACKS = ("previous", "average", "raise")


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration (field ``foo_bar`` is run-config key ``foo-bar``)."""

    mode: str = "multi-round"
    dataset: str = "digits"
    data_root: str = ""
    model: str = "mlp"
    model_width: int = 64
    model_depth: int = 2
    num_clients: int = 4
    partitioning: str = "shards"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 0
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    num_server_rounds: int = 3
    local_epochs: int = 2
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 0.005
    weight_decay: float = 0.0
    importance: str = "deeplift"
    importance_samples: int = 256
    tofu_r: int = 0
    strategy: str = "kf-linear"
    fusion_set_size: int = 300
    fusion_set_source: str = "public"
    fusion_set_path: str = ""
    fusion_options: str = ""
    public_fraction: float = 0.2
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    fusion_fallback: str = "previous"
    fusion_rounds: int = 0
    seed: int = 0
    device: str = "auto"
    output_dir: str = "results"
    run_name: str = ""
    round_timeout: float = 3600.0
    resume: bool = False
    test_faults: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}


_CHOICES = {"mode": MODES, "model": MODELS, "partitioning": PARTITIONINGS, "optimizer": OPTIMIZERS,
            "importance": IMPORTANCE, "fusion_set_source": FUSION_SOURCES, "fusion_fallback": FALLBACKS}
_POSITIVE = ("model_width", "model_depth", "num_clients", "num_server_rounds", "local_epochs", "batch_size",
             "fusion_set_size", "importance_samples", "min_train_nodes")


class ConfigError(ValueError):
    """A bad run-config key or value; the message names the key."""


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            return value
        elif isinstance(value, float) and value.is_integer():
            return int(value)
        elif isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"run-config key {key!r}: expected {typ.__name__}, got {value!r}")


def parse_run_config(run_config: Mapping[str, Any] | None, *, strict: bool = True,
                     known_strategies: tuple[str, ...] | None = None) -> RunConfig:
    """Validate a Flower ``context.run_config`` (missing keys take defaults; under ``run_simulation``
    the mapping is empty). Unknown keys raise ``ConfigError`` when ``strict``."""
    run_config = dict(run_config or {})
    types = {f.name: f.type for f in fields(RunConfig)}
    pytypes = {"int": int, "float": float, "str": str, "bool": bool}
    values: dict[str, Any] = {}
    for key, value in run_config.items():
        name = key.replace("-", "_")
        if name not in types:
            if strict:
                valid = ", ".join(sorted(k.replace("_", "-") for k in types))
                raise ConfigError(f"run-config: unknown key {key!r}; valid keys: {valid}")
            continue
        values[name] = _coerce(key, value, pytypes[types[name]])
    cfg = RunConfig(**values)
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"run-config key {name.replace('_', '-')!r}: {getattr(cfg, name)!r} is not one of "
                              f"{list(choices)}")
    if cfg.dataset not in DATASETS and not cfg.dataset.startswith("hf:"):
        raise ConfigError(f"run-config key 'dataset': unknown dataset {cfg.dataset!r}; choose one of "
                          f"{list(DATASETS)} or 'hf:<hub name>'")
    for name in _POSITIVE:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"run-config key {name.replace('_', '-')!r} must be >= 1, got {getattr(cfg, name)}")
    for name in ("val_fraction", "test_fraction", "public_fraction"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"run-config key {name.replace('_', '-')!r} must be in [0, 1), got {getattr(cfg, name)}")
    if not 0.0 < cfg.fraction_train <= 1.0:
        raise ConfigError(f"run-config key 'fraction-train' must be in (0, 1], got {cfg.fraction_train}")
    if cfg.resume and not cfg.run_name:
        raise ConfigError("run-config key 'resume' needs a fixed 'run-name' (the run to continue lives in "
                          "<output-dir>/<run-name>)")
    if cfg.round_timeout <= 0:
        raise ConfigError(f"run-config key 'round-timeout' must be > 0 seconds, got {cfg.round_timeout}")
    if cfg.test_faults:
        from fedfuse.faults import parse_faults

        try:
            parse_faults(cfg.test_faults)
        except ValueError as exc:
            raise ConfigError(f"run-config key 'test-faults': {exc}") from exc
    if cfg.fusion_rounds < 0:
        raise ConfigError(f"run-config key 'fusion-rounds' must be >= 0 (0 = fuse every round), got {cfg.fusion_rounds}")
    if cfg.tofu_r < 0:
        raise ConfigError(f"run-config key 'tofu-r' must be >= 0, got {cfg.tofu_r}")
    if cfg.tofu_r > 0 and cfg.model != "vit":
        raise ConfigError(f"run-config key 'tofu-r': Token Fusion applies to model 'vit' only, not {cfg.model!r}")
    fusion_options_dict(cfg)  # fails here, naming the key, if the string is not a TOML inline table
    if cfg.lr <= 0:
        raise ConfigError(f"run-config key 'lr' must be > 0, got {cfg.lr}")
    if cfg.dirichlet_alpha <= 0:
        raise ConfigError(f"run-config key 'dirichlet-alpha' must be > 0, got {cfg.dirichlet_alpha}")
    if cfg.min_train_nodes > cfg.num_clients:
        raise ConfigError(f"run-config key 'min-train-nodes' ({cfg.min_train_nodes}) exceeds 'num-clients' "
                          f"({cfg.num_clients})")
    if not (cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:")):
        raise ConfigError(f"run-config key 'device': {cfg.device!r} is not auto, cpu, cuda or cuda:N")
    if known_strategies is not None and cfg.strategy not in known_strategies:
        raise ConfigError(f"run-config key 'strategy': unknown strategy {cfg.strategy!r}; choose one of "
                          f"{sorted(known_strategies)}")
    if cfg.mode == "one-shot" and cfg.num_server_rounds != 1:
        # one-shot fusion is one round by definition; say so rather than silently overriding
        raise ConfigError("run-config key 'num-server-rounds' must be 1 when 'mode' is 'one-shot'")
    return cfg


def fusion_options_dict(cfg: RunConfig) -> dict[str, Any]:
    """``fusion-options`` (a TOML inline table, e.g. ``"{ridge=1e-3, head_weights=true}"``) as a dict."""
    import tomllib

    text = cfg.fusion_options.strip()
    if not text:
        return {}
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"run-config key 'fusion-options': not a TOML inline table ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"run-config key 'fusion-options': expected an inline table like '{{ridge=1e-3}}', got {text!r}")
    return value
