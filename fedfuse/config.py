"""Run-config schema: every key of ``[tool.flwr.app.config]`` / ``--run-config`` is declared here, once.

``RunConfig`` *is* the schema: each field is one run-config key (field ``foo_bar`` is key ``foo-bar``)
with its type (the annotation), its default, and in its metadata the help text and the allowed values
or range (``SCHEMA`` lists them as ``KeySpec`` records; ``python -m fedfuse.config`` prints them).
``[tool.flwr.app.config]`` in ``pyproject.toml`` repeats the defaults only because Flower reads them
from there; ``tests/test_config.py`` checks that both agree value by value.

The allowed-value lists (datasets, models, partitionings, optimizers, importance methods, fusion-set
sources, fallbacks) live here too; ``fedfuse.data`` and the strategy import them from this module.

Checks, all before any Flower process starts and without loading data:

- ``parse_run_config(mapping) -> RunConfig``: unknown keys (with a close match), types, allowed values,
  ranges, rules between keys, ``fusion-options`` against the chosen method's typed options
  (``fedfuse.fusion.METHOD_SPECS[strategy].parse_options``) and whether the method can run on this setup
  (clients per round, model family, affine levels, a fusion set; ``MethodSpec.check_setup``).
- ``check_files(cfg)``: the files the config names: ``fusion-set-path`` (existence, format, shape, dtype,
  finite values, value range against the dataset's preprocessing) and ``data-root``.
- ``check_model(cfg)``: the model builds for the dataset's input shape and maps a batch to logits.
- ``check_device(cfg)`` / ``check_output_dir(cfg)``: ``device='cuda[:N]'`` has that device here; ``output-dir``
  can be created and written in.
- ``preflight(mapping)``: all of the above; every runner calls it before it starts Flower.

Every failure is a ``ConfigError`` (a ``ValueError``) with one line that names the key. What is known
about a dataset without loading it (input shape, classes, value scale) comes from
``fedfuse.data.sources.SOURCE_INFO``; ``hf:<name>`` datasets are only known once loaded, so their
shape checks run in the ServerApp (``check_files(cfg, input_shape=..., num_classes=...)``).
This module imports no Flower; ``fedfuse.fusion`` is imported by the checks only (``_fusion_registry``).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
import sys
import tempfile
import typing
import warnings
from dataclasses import replace, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

# allowed values (one place: fedfuse.choices), re-exported as part of the schema
from fedfuse.choices import (DATASETS, FALLBACKS, FUSION_SET_SOURCES, HF_PREFIX, IMPORTANCE,  # noqa: E402
                             MODEL_FAMILIES, MODEL_SIZES, MODELS, MODES, OPTIMIZERS, PARTITIONINGS)
from fedfuse.choices import BEST_CLIENT  # noqa: E402
from fedfuse.choices import DP_CLIPPINGS  # noqa: E402
from fedfuse.choices import EVALUATIONS, HEAD_SOLVER_CHOICES, no_fusion_options, ONE_SHOT_REFERENCES, PRIORS, REFINES  # noqa: E402
# the measured defaults and one-shot rules (one place: fedfuse.plan), re-exported
from fedfuse.plan import (AUTO_SERVER_MOMENTUM, auto_candidates, auto_round_aggregation, dp_strategy,  # noqa: E402
                          one_shot_depth_default, one_shot_width_default)
from fedfuse.config_layout import OPTION_TABLES, PATH_KEYS, TABLE_PATHS, canonical_run_config, path_of  # noqa: E402
from fedfuse.strategy_specs import AUTO_FUSION_EPOCHS, DEFAULT_CANDIDATES  # noqa: E402  (auto's defaults)
from fedfuse.strategy_specs import (DEPTH_TIER_STRATEGIES, DEPTH_WARM_START, DP_STRATEGIES, FLOWER_BASELINE_STRATEGIES,  # noqa: E402
                                    NON_FUSION_STRATEGIES, STRATEGY_KEYS, SUBMODEL_METHODS, key_applies,
                                    WIDTH_DEPTH_TIER_METHODS, ARRAY_CANDIDATES, check_candidates, DEPTH_METHODS, MEAN_METHODS,
                                    SELECTING_STRATEGIES, strategy_spec, strategy_names as registry_names)
from fedfuse.hetero.tiers import (ORDERED_DROPOUT, ORDERED_DROPOUT_DRAWS, TIER_MODELS, TIER_STRATEGIES,  # noqa: E402
                                  has_depth_tiers, parse_tier_pairs, parse_tiers, resolve_tier_models)
from fedfuse.data import FederatedData  # noqa: E402
from fedfuse.data.fusion_set import check_fusion_inputs, load_fusion_file  # noqa: E402
from fedfuse.data.node_data import load_node_data  # noqa: E402
from fedfuse.data.sources import IDX_SOURCES, TORCHVISION_SOURCES, idx_files_problem, source_info  # noqa: E402
from fedfuse.models import build_model, levels, model_family  # noqa: E402
from fedfuse.models.zoo import input_problem as zoo_input_problem, is_zoo_name, zoo_name_problem  # noqa: E402


class ConfigError(ValueError):
    """A bad run-config key or value; the one-line message names the key."""


class ConfigNote(UserWarning):
    """A value the config check resolved for the user (``strategy='auto'`` with ``client-tiers`` → the tiered default,
    ``min-train-nodes`` left at its default raised to what ``krum`` / ``multikrum`` / ``bulyan`` need, ...), warned by
    ``parse_run_config``. The ServerApp logs each once and records it (``results.json`` ``"config-notes"``); the
    ClientApps and the runners, which parse the same config, collect theirs silently (``config_notes``)."""


@contextlib.contextmanager
def config_notes():
    """Collect the ``ConfigNote`` warnings raised inside (the list yielded is filled, without repeats, on exit);
    any other warning is passed on unchanged."""
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNote)
        yield notes
    for w in caught:
        if issubclass(w.category, ConfigNote):
            if str(w.message) not in notes:
                notes.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _key(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
         gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A run-config key: ``default``, ``help`` text, allowed ``choices`` or a range (``ge``/``gt``/``le``/``lt``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt})


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration (field ``foo_bar`` is run-config key ``foo-bar``)."""

    mode: str = _key("multi-round", "multi-round FL, one-shot (one round, one fusion) or warm-start (a one-shot "
                                    "round 1, then multi-round) (docs/configuration.md#top-level-keys)", choices=MODES)
    dataset: str = _key("digits", f"the data source: a built-in dataset or {HF_PREFIX}<name> (Hugging Face) "
                                  "(docs/configuration.md#top-level-keys)", choices=DATASETS)
    data_root: str = _key("", "folder of the dataset's files: torchvision root, idx files or a save_to_disk folder "
                              "(docs/configuration.md#top-level-keys)")
    model: str = _key("mlp", "fedfuse's own architecture or a zoo model torchvision:<name> / timm:<name>, randomly "
                             "initialised (docs/configuration.md#zoo-models)", choices=MODELS)
    model_width: int = _key(0, "hidden width / channels; 0 = the model's own (64; lenet: 6) "
                               "(docs/configuration.md#top-level-keys)", ge=0)
    model_depth: int = _key(0, "hidden layers / blocks; 0 = the model's own (2)", ge=0)
    num_clients: int = _key(4, "number of clients (partitions)", ge=1)
    partitioning: str = _key("dirichlet", "how the train pool is split across clients", choices=PARTITIONINGS)
    dirichlet_alpha: float = _key(0.1, "Dirichlet concentration of partitioning='dirichlet' (small = skewed)", gt=0)
    classes_per_client: int = _key(0, "partitioning='shards': classes per client; 0 = all classes split evenly "
                                      "(class-disjoint)", ge=0)
    val_fraction: float = _key(0.1, "each client's validation hold-out", ge=0, lt=1)
    test_fraction: float = _key(0.2, "test split for datasets without one", gt=0, lt=1)
    num_server_rounds: int = _key(10, "federated rounds", ge=1)
    local_epochs: int = _key(2, "client epochs per round", ge=1)
    batch_size: int = _key(32, "client batch size", ge=1)
    optimizer: str = _key("adam", "client optimizer", choices=OPTIMIZERS)
    lr: float = _key(0.005, "client learning rate", gt=0)
    weight_decay: float = _key(0.0, "client weight decay", ge=0)
    momentum: float = _key(0.9, "client SGD momentum (optimizer='sgd'); 0 = plain SGD, as Flower's fedavgm baseline",
                           ge=0, lt=1)
    importance: str = _key("deeplift", "neuron-importance method the clients use (captum)", choices=IMPORTANCE)
    importance_samples: int = _key(256, "validation samples each client scores", ge=1)
    tofu_r: int = _key(0, "ViT clients: Token Fusion tokens removed per block in local training and evaluation "
                          "(0 = off)", ge=0)
    strategy: str = _key("auto", "auto (the average, or the clients' best-scored candidate), fedavg, a Flower "
                                 "baseline or a fusion method (docs/multi-round.md#strategy-auto)")
    fusion_set_size: int = _key(2000, "samples in the server's unlabeled fusion set (at least 2; the default takes "
                                      "the whole pool when it holds fewer) (docs/configuration.md#top-level-keys)",
                                ge=2)
    fusion_set_source: str = _key("public", "public (a held-out pool no client sees) | client0 (drawn from client "
                                            "0's partition: skewed)", choices=FUSION_SET_SOURCES)
    fusion_set_path: str = _key("", "optional .pt/.npz file of fusion inputs, an absolute path on the server "
                                    "(docs/configuration.md#top-level-keys)")
    partition_files: str = _key("", "simulation on given client splits: a file path pattern with {partition-id}, "
                                    "one .npz per client (docs/configuration.md#data-options)")
    test_set_path: str = _key("", "optional .pt/.npz file with the central test set (x, y) "
                                  "(docs/configuration.md#data-options)")
    evaluation: str = _key("central", "where the global model is tested every round: central (the server) | "
                                      "federated (the clients) | both (docs/configuration.md#top-level-keys)",
                           choices=EVALUATIONS)
    one_shot_references: str = _key("all", "mode='one-shot': reference rows from the same client models: "
                                           "all | models (no KD, FedDF) | none "
                                           "(docs/one-shot.md#what-a-one-shot-run-prints)",
                                    choices=ONE_SHOT_REFERENCES)
    client_references: bool = _key(True, "every round, each reply's and the clients' ensemble's accuracy on the "
                                         "server's test set (docs/configuration.md#report-options)")
    head_round: bool = _key(True, "after the last round, the classifier solved in closed form from the clients' "
                                  "statistics (docs/multi-round.md#the-head-round)")
    secure_aggregation: bool = _key(False, "head round: the server sees only the sum of the statistics "
                                           "(Flower's SecAgg+) "
                                           "(docs/trust.md#secure-sums-head-optionssecure-aggregationtrue)")
    head_ridge: float = _key(1e-3, "head round: ridge of the closed-form head, per sample", ge=0)
    head_solver: str = _key("best", "head round: the closed-form classifier: ridge | lda | best (the clients' "
                                    "pick) (docs/multi-round.md#the-head-round)",
                            choices=HEAD_SOLVER_CHOICES)
    fusion_options: str = _key("", "the fusion method's options as a TOML inline table, e.g. \"{head_weights=true, "
                                   "ridge=1e-3}\"")
    public_fraction: float = _key(0.2, "share of the train pool held out as the server's public fusion pool",
                                  ge=0, lt=1)
    fraction_train: float = _key(1.0, "fraction of clients sampled per round", gt=0, le=1)
    min_train_nodes: int = _key(2, "minimum clients sampled per round and minimum valid replies", ge=1)
    fusion_fallback: str = _key("previous", "when fusion fails: previous (keep the global model) | average | raise",
                                choices=FALLBACKS)
    fusion_rounds: int = _key(0, "fuse in rounds 1..N only, weighted averaging afterwards; 0 = every round (not "
                                 "mode='one-shot')", ge=0)
    refine: str = _key("auto", "fusion strategies: how each aggregate is refined on the fusion set; auto = the "
                               "strategy's default (docs/configuration.md#strategy-options)", choices=REFINES)
    refine_prior: str = _key("auto", "class prior of refine='calibrate': class-counts | uniform | auto (class "
                                     "counts when every client sends them)", choices=PRIORS)
    divergence_guard: bool = _key(True, "multi-round fusion: the average replaces a fused model far from the "
                                        "clients' ensemble (docs/multi-round.md#how-average-aggregates)")
    server_lr: float = _key(0.0, "server learning rate of fedavgm | fedadam | fedyogi | fusion strategies; 0 = the "
                                 "strategy's default (docs/configuration.md#strategy-options)", ge=0)
    server_momentum: float = _key(-1.0, "fedavgm | fusion strategies: server momentum; 0 = none, -1 = the "
                                        "strategy's default (docs/configuration.md#strategy-options)", ge=-1, lt=1)
    auto_candidates: str = _key(",".join(DEFAULT_CANDIDATES), "strategy='auto': the candidate aggregations, "
                                                        "comma-separated, first preferred on a tie "
                                                        "(docs/multi-round.md#strategy-auto)")
    auto_fusion_epochs: int = _key(AUTO_FUSION_EPOCHS, "strategy='auto': fusion candidates only from this many "
                                   "local-epochs (0 = "
                                       "always) (docs/multi-round.md#strategy-auto)", ge=0)
    auto_momentum: str = _key("auto", "auto's server momentum: auto (for plain-SGD clients) | on | off "
                                      "(docs/multi-round.md#server-momentum-for-plain-sgd-clients-auto-momentum)",
                              choices=("auto", "on", "off"))
    align_to: str = _key("model-0", "rebasin | ot: align the clients onto model-0 (the first reply) or global "
                                    "(docs/multi-round.md#fusion-aligned-to-the-global-model)",
                         choices=("model-0", "global"))
    proximal_mu: float = _key(0.0, "fedprox: weight mu of the clients' proximal term mu/2 ||w - w_global||^2", ge=0)
    trim_beta: float = _key(0.2, "fedtrimmedavg: the fraction of largest and of smallest values cut per coordinate "
                                 "(Flower's beta)", ge=0, lt=0.5)
    num_malicious_nodes: int = _key(0, "krum | multikrum | bulyan: f, the malicious clients tolerated (Flower's "
                                       "num_malicious_nodes)", ge=0)
    num_nodes_to_select: int = _key(1, "multikrum: the best-scored client models averaged (Flower's "
                                       "num_nodes_to_select)", ge=1)
    mom_beta: float = _key(0.2, "inclusivefl: beta of the momentum distillation into shallower tiers; 0 = "
                                "DepthFL's average (docs/tiers.md#depth-tiers)", ge=0, le=1)
    robust: bool = _key(False, "fedfuse's reply screen: drop free riders, outsized and off-direction updates, "
                               "bound norms (docs/trust.md#the-robust-setting-robusttrue)")
    robust_cluster: str = _key("off", "robust's direction check: off (cosine to the median update) | flame | core "
                                      "| core-positive (docs/trust.md#clustering-the-updates-flame)",
                               choices=("off", "flame", "core", "core-positive"))
    robust_cosine_mads: float = _key(0.0, "robust: the direction line at most the median cosine minus this many "
                                          "scaled MADs; 0 = off (docs/configuration.md#robust-options)", ge=0)
    robust_cluster_min_samples: int = _key(1, "robust-options.cluster: HDBSCAN's min_samples (FLAME's 1; "
                                              "0 = the minimum cluster size) "
                                              "(docs/trust.md#clustering-the-updates-flame)", ge=0)
    dp_noise_multiplier: float = _key(0.0, "client-level central DP: the Gaussian noise multiplier; 0 = off "
                                           "(docs/trust.md#a-dp-run-is-configuration)", ge=0)
    dp_clipping_norm: float = _key(0.0, "DP: the L2 bound on each client's update (needed with "
                                        "dp-options.noise-multiplier)", ge=0)
    dp_clipping: str = _key("server", "DP: where updates are clipped: server | client (the server never sees an "
                                      "unclipped update) (docs/trust.md#a-dp-run-is-configuration)",
                            choices=DP_CLIPPINGS)
    dp_delta: float = _key(1e-5, "DP: the delta at which epsilon is reported", gt=0, lt=1)
    dp_max_epsilon: float = _key(0.0, "DP: stop the run before a release would take epsilon above this; 0 = no "
                                      "limit", ge=0)
    dp_head_noise_multiplier: float = _key(0.0, "DP: the private head round's noise multiplier; "
                                                "0 = dp-options.noise-multiplier "
                                                "(docs/trust.md#the-private-head-round)", ge=0)
    dp_head_projection: int = _key(8, "DP: the private head round keeps the features' top k principal directions; "
                                      "0 = all (docs/trust.md#the-private-head-round)", ge=0)
    seed: int = _key(0, "seed of everything random", ge=0)
    device: str = _key("auto", "auto (CUDA when present) | cpu | cuda | cuda:N")
    output_dir: str = _key("results", "results root; a run writes <output-dir>/<run-name>/")
    run_name: str = _key("", "results folder name ('' = strategy-dataset-model-...-timestamp)")
    round_timeout: float = _key(3600.0, "seconds a round waits for client replies", gt=0)
    resume: bool = _key(False, "continue <output-dir>/<run-name> from its last checkpointed round "
                               "(docs/deployment.md#fault-tolerance-and-resume)")
    client_tiers: str = _key("", "capacity tiers: width multipliers ('1,0.5') or <width>x<depth> ('1x1,1x0.5'), "
                                 "round-robin by partition id; '' = off (docs/tiers.md)")
    tier_models: str = _key("auto", "client-tiers: each tier's model every round: auto | slice | fuse | distill | "
                                    "prune | prune-recover (docs/configuration.md#tier-options)",
                            choices=TIER_MODELS)
    ordered_dropout: str = _key("auto", "client-tiers: clients also train narrower tiers' sub-models (FjORD): "
                                        "auto | all | narrow | off (docs/configuration.md#tier-options)",
                                choices=ORDERED_DROPOUT)
    ordered_dropout_draw: str = _key("auto", "ordered dropout's width draw per batch: auto | uniform | width | "
                                             "sandwich | a number in (0, 1) (docs/configuration.md#tier-options)")
    warm_start_epochs: int = _key(20, "mode='warm-start': local epochs of round 1, each client training its own "
                                      "model (docs/warm-start.md)", ge=1)
    warm_start_lr: float = _key(0.0, "mode='warm-start': the clients' learning rate in round 1 (0 = lr)", ge=0)
    warm_start_fusion: str = _key("kf-linear", "mode='warm-start': how round 1 combines the clients' models: "
                                               "a fusion method or best-client "
                                               "(docs/configuration.md#warm-start-options)")
    warm_start_fusion_options: str = _key("{importance='uniform'}",
                                          "mode='warm-start': warm-start-options.fusion's options as a TOML inline "
                                          "table; '' = its defaults (docs/configuration.md#warm-start-options)")
    initial_model_path: str = _key("", "a .pt state dict the run starts from instead of a fresh initialisation "
                                       "(absolute path on the server) (docs/configuration.md#top-level-keys)")

    def __post_init__(self) -> None:
        # 0 = the model's own size (fedfuse.choices.MODEL_SIZES): resolved here, so every reader sees the real one;
        # a zoo model's size is its own and stays 0 (_check_zoo_model rejects any other value)
        if is_zoo_name(self.model):
            return
        width, depth = MODEL_SIZES.get(self.model, (64, 2))
        if self.model_width == 0:
            object.__setattr__(self, "model_width", width)
        if self.model_depth == 0:
            object.__setattr__(self, "model_depth", depth)

    def to_dict(self) -> dict[str, Any]:
        """The config in its canonical form (top-level keys and dotted option-table paths, Flower's flat form)."""
        return {path_of(f.name.replace("_", "-")): getattr(self, f.name) for f in fields(self)}

    # parsed once, here: nothing downstream re-parses these strings
    @cached_property
    def tiers(self) -> tuple[float, ...]:
        """``client-tiers`` parsed (``()`` without tiers); ``ConfigError`` naming the key."""
        try:
            if self.depth_tiers:
                return ()   # depth tiers (fedfuse.hetero.depth): every client at full width
            return parse_tiers(self.client_tiers, key="run-config key 'client-tiers'")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @cached_property
    def depth_tiers(self) -> tuple[float, ...]:
        """The depth multipliers of ``client-tiers`` when it names a tier shallower than the global model
        (``<width>x<depth>`` entries; their widths: ``depth_tier_widths``), round-robin by partition id as width
        tiers; ``()`` otherwise."""
        try:
            if not has_depth_tiers(self.client_tiers, key="run-config key 'client-tiers'"):
                return ()
            pairs = parse_tier_pairs(self.client_tiers, key="run-config key 'client-tiers'")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return tuple(d for _, d in pairs)

    @cached_property
    def depth_tier_widths(self) -> tuple[float, ...]:
        """With depth tiers, the width multiplier of each ``client-tiers`` entry (aligned with ``depth_tiers``; all 1
        unless width × depth tiers, e.g. ``'1x1,1x0.5,0.5x0.5'``); ``()`` without depth tiers."""
        if not self.depth_tiers:
            return ()
        return tuple(w for w, _ in parse_tier_pairs(self.client_tiers, key="run-config key 'client-tiers'"))

    @cached_property
    def fusion_options_table(self) -> dict[str, Any]:
        """``fusion-options`` parsed from its TOML inline table; ``ConfigError`` naming the key."""
        return _parse_fusion_options(self.fusion_options)

    @cached_property
    def auto_candidate_names(self) -> tuple[str, ...]:
        """``auto-candidates`` split on commas (checked by ``validate``)."""
        return tuple(c.strip() for c in self.auto_candidates.split(","))

    @cached_property
    def warm_start_fusion_options_table(self) -> dict[str, Any]:
        """``warm-start-fusion-options`` parsed from its TOML inline table; ``ConfigError`` naming the key."""
        return _parse_fusion_options(self.warm_start_fusion_options, key="warm-start-fusion-options")


@dataclass(frozen=True)
class KeySpec:
    """One run-config key as declared in ``RunConfig``."""

    key: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    @property
    def path(self) -> str:
        """Where a user writes the setting: the key, or its option table's dotted path
        (``fedfuse.config_layout``)."""
        return path_of(self.key)

    def range_text(self) -> str:
        lo = f">= {self.ge}" if self.ge is not None else (f"> {self.gt}" if self.gt is not None else "")
        hi = f"<= {self.le}" if self.le is not None else (f"< {self.lt}" if self.lt is not None else "")
        return " and ".join(t for t in (lo, hi) if t)


def _schema() -> dict[str, KeySpec]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name.replace("_", "-"): KeySpec(key=f.name.replace("_", "-"), type=hints[f.name], default=f.default,
                                              **dict(f.metadata))
            for f in fields(RunConfig)}


SCHEMA: dict[str, KeySpec] = _schema()
"""setting key -> ``KeySpec`` (type, default, help, allowed values / range), in declaration order; a setting of an
option table is written at ``KeySpec.path`` (``dp-noise-multiplier`` at ``dp-options.noise-multiplier``)."""
#: the top-level settings (every other setting lives in an option table of ``fedfuse.config_layout.OPTION_TABLES``)
TOP_LEVEL: tuple[str, ...] = tuple(k for k in SCHEMA if k not in TABLE_PATHS)
#: the keys a run config's top level holds: the top-level settings and the option tables
TOP_LEVEL_KEYS: tuple[str, ...] = TOP_LEVEL + tuple(OPTION_TABLES)


# ------------------------------------------------------------------------------------------- parsing
def _coerce(key: str, value: Any, typ: type) -> Any:
    """``value`` as ``typ``: int → float, integral float → int, and numeric / true|false strings are accepted."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
        elif isinstance(value, str):
            try:
                v = float(value)
                if math.isfinite(v):
                    return v
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, dict) and key == "fusion-options":
            raise ConfigError("run-config key 'fusion-options': pass the table as a quoted string, "
                              "e.g. fusion-options=\"{ridge=1e-3}\"")
    raise ConfigError(f"run-config key {path_of(key)!r}: expected {typ.__name__}, got {value!r}")


def _unknown_key(key: str, strict: bool) -> None:
    if not strict:
        return
    if key.startswith("fusion-options."):  # an unquoted inline table that Flower flattened
        raise ConfigError(f"run-config: unknown key {key!r}; write fusion-options as a quoted string, "
                          "e.g. fusion-options=\"{ridge=1e-3}\"")
    close = difflib.get_close_matches(key, list(TOP_LEVEL_KEYS) + list(PATH_KEYS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"run-config: unknown key {key!r}{hint}; `python -m fedfuse.config` lists all keys")


def _check_range(spec: KeySpec, value: Any) -> None:
    if spec.choices is not None and value not in spec.choices:
        if spec.key == "dataset" and isinstance(value, str) and value.startswith(HF_PREFIX):
            if len(value) > len(HF_PREFIX):
                return
            raise ConfigError("run-config key 'dataset': 'hf:' needs a name, e.g. 'hf:uoft-cs/cifar10'")
        if spec.key == "model" and is_zoo_name(value):
            problem = zoo_name_problem(value)
            if problem is None:
                return
            raise ConfigError(f"run-config key 'model': {problem}")
        close = difflib.get_close_matches(str(value), [str(c) for c in spec.choices], n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        extra = {"dataset": f" or '{HF_PREFIX}<name>'",
                 "model": " or a zoo model 'torchvision:<name>' / 'timm:<name>'"}.get(spec.key, "")
        raise ConfigError(f"run-config key {spec.path!r}: {value!r} is not one of {list(spec.choices)}{extra}{hint}")
    ok = ((spec.ge is None or value >= spec.ge) and (spec.gt is None or value > spec.gt)
          and (spec.le is None or value <= spec.le) and (spec.lt is None or value < spec.lt))
    if not ok:
        raise ConfigError(f"run-config key {spec.path!r} must be {spec.range_text()}, got {value!r}")


def parse_run_config(run_config: Mapping[str, Any] | None, *, strict: bool = True,
                     known_strategies: tuple[str, ...] | None = None) -> RunConfig:
    """Validate a run config (Flower's ``context.run_config`` or ``--run-config`` overrides) into a ``RunConfig``.

    Missing keys take the schema defaults (under ``run_simulation`` the mapping is empty). Unknown keys
    raise when ``strict``. ``known_strategies`` (the ServerApp passes its registry) replaces the default
    strategy list (``strategy_names()``). Raises ``ConfigError`` naming the key; imports no Flower.
    """
    values: dict[str, Any] = {}
    for path, value in canonical(run_config).items():
        spec = SCHEMA.get(PATH_KEYS.get(path, path))
        if spec is None:
            _unknown_key(path, strict)
            continue
        values[spec.key.replace("-", "_")] = _coerce(path, value, spec.type)
    cfg = RunConfig(**values)
    if cfg.strategy in SELECTING_STRATEGIES and cfg.client_tiers.strip():
        # auto scores candidates of one architecture; the tiered default is 'average' (docs/tiers.md), except in
        # one-shot mode, whose clients start from their own initialisations: their plain (sub-model) average is at
        # chance, so there the default fuses them (one_shot_width_default) or, across depths, aligns them first ('ot')
        # or distils ('feddf'): one_shot_depth_default. Loud, and recorded: the run's config (results.json) says which.
        tiered = "average"
        if cfg.mode == "one-shot":
            tiered = one_shot_depth_default(cfg) if cfg.depth_tiers else one_shot_width_default(cfg)
        warnings.warn(f"run-config key 'strategy': 'auto' has no capacity-tier form; with 'client-tiers' the run uses "
                      f"{tiered!r} (the tiered default). Set strategy explicitly to silence this.", ConfigNote,
                      stacklevel=2)
        cfg = replace(cfg, strategy=tiered)
    if cfg.mode == "warm-start" and cfg.depth_tiers:
        if cfg.warm_start_fusion_options == SCHEMA["warm-start-fusion-options"].default:
            cfg = replace(cfg, warm_start_fusion_options="")   # kf-linear's options: the depth aggregations take none
        if cfg.warm_start_fusion == SCHEMA["warm-start-fusion"].default:
            # kf-linear fuses models of one architecture; across depths round 1 takes the one-shot depth-tier default
            # (ot aligns models of one width, so width x depth tiers distil). Loud, and recorded in the run's config.
            fusion = one_shot_depth_default(cfg)
            warnings.warn(f"run-config key 'warm-start-options.fusion': the default 'kf-linear' fuses models of one "
                          f"architecture; with depth tiers round 1 combines the clients' models with {fusion!r}. Set "
                          "warm-start-fusion explicitly to silence this.", ConfigNote, stacklevel=2)
            cfg = replace(cfg, warm_start_fusion=fusion)
    if cfg.robust and cfg.mode == "one-shot":
        # the update screen compares each update with the global model the clients trained from; one-shot clients
        # start from their own models, so there only their answers (auto's vote, the head round) are screened
        warnings.warn("run-config key 'robust': in mode='one-shot' the clients start from their own models, so the "
                      "update screen does not apply; the robust setting screens their answers only (auto's vote "
                      "and the head round's statistics and check, docs/trust.md)", ConfigNote, stacklevel=2)
    need = robust_min_replies(cfg)
    if cfg.min_train_nodes == SCHEMA["min-train-nodes"].default and cfg.min_train_nodes < need <= cfg.num_clients:
        # a strategy runs with the defaults: min-train-nodes left at its default (the value pyproject.toml repeats, so
        # the ServerApp cannot tell it from an explicit 2) becomes what the strategy needs. Loud, and recorded: the
        # run's config (results.json) holds the value used, "config-notes" this line. A value set below it fails.
        warnings.warn(f"run-config key 'strategy-options.min-train-nodes': strategy {cfg.strategy!r} needs at least {need} replies a "
                      f"round ({_robust_rule(cfg)}); strategy-options.min-train-nodes is at its default "
                      f"{cfg.min_train_nodes}, so the run uses {need}. Set strategy-options.min-train-nodes >= {need} to silence this.",
                      ConfigNote, stacklevel=2)
        cfg = replace(cfg, min_train_nodes=need)
    for spec in SCHEMA.values():
        _check_range(spec, getattr(cfg, spec.key.replace("-", "_")))
    _check_rules(cfg)
    _check_method(cfg, tuple(known_strategies) if known_strategies is not None else strategy_names())
    _check_strategy_keys(cfg)
    return cfg


def robust_min_replies(cfg: RunConfig) -> int:
    """The replies a round that ``cfg.strategy`` needs with ``num-malicious-nodes`` f: Bulyan 4f + 3, Krum / MultiKrum
    f + 3 (each model scored by its n - f - 2 nearest others); 1 for any other strategy."""
    a, b = _min_replies(cfg)
    return a * cfg.num_malicious_nodes + b


def _min_replies(cfg: RunConfig) -> tuple[int, int]:
    """The entry's ``min_replies`` ``(a, b)`` (``a * f + b``); ``(0, 1)`` for an unknown strategy (checked later)."""
    try:
        return strategy_spec(cfg.strategy).min_replies
    except ValueError:
        return 0, 1


def _robust_rule(cfg: RunConfig) -> str:
    f = cfg.num_malicious_nodes
    a, b = _min_replies(cfg)
    return (f"Flower's {strategy_spec(cfg.strategy).flower_class}: {a}f + {b}, f = {f}: 'strategy-options.num-malicious-nodes'"
            if a > 1 else
            f"Krum scores each model by its n - f - 2 nearest others: f + {b}, f = {f}: 'strategy-options.num-malicious-nodes'")


def _check_privacy(cfg: RunConfig) -> None:
    """A DP run (``dp-noise-multiplier`` > 0): what Flower's DP wrappers bound, and nothing they do not."""
    dp_keys = ("dp-clipping-norm", "dp-clipping", "dp-delta", "dp-max-epsilon", "dp-head-noise-multiplier",
               "dp-head-projection")
    if cfg.dp_noise_multiplier == 0:
        for key in dp_keys:
            if getattr(cfg, key.replace("-", "_")) != SCHEMA[key].default:
                raise ConfigError(f"run-config key {path_of(key)!r} applies to differentially private runs only: set "
                                  "'dp-options.noise-multiplier' > 0 (0 = no DP)")
        return
    if cfg.dp_clipping_norm <= 0:
        raise ConfigError("run-config key 'dp-options.clipping-norm' must be > 0 with dp-options.noise-multiplier > 0 (the bound on "
                          "each client's update that the noise is calibrated to)")
    strategy = dp_strategy(cfg)
    if strategy not in DP_STRATEGIES:
        why = ("'auto' builds fusion candidates from each client's model and asks the clients to score them "
               f"(local-epochs {cfg.local_epochs} >= strategy-options.auto-fusion-epochs {cfg.auto_fusion_epochs})"
               if cfg.strategy in SELECTING_STRATEGIES else
               f"{cfg.strategy!r} reads each client's model on its own (fusion, distillation, selection, medians), so "
               "one client's influence on its result is not the clipping norm / n that the noise is calibrated to")
        raise ConfigError(f"run-config key 'strategy': differential privacy (dp-options.noise-multiplier > 0) bounds averaging "
                          f"strategies only ({', '.join(DP_STRATEGIES)}); {why}")
    if cfg.mode != "multi-round":
        raise ConfigError(f"run-config key 'mode': differential privacy applies to multi-round runs, not "
                          f"{cfg.mode!r} (one-shot and warm-start rounds fuse independently trained models)")
    if cfg.client_tiers.strip():
        raise ConfigError("run-config key 'client-tiers': differential privacy bounds one architecture's average; "
                          "tier replies are sub-models of other widths")
    if cfg.robust:
        raise ConfigError("run-config key 'robust': the screen drops and shrinks replies by comparing them with each "
                          "other, which the DP account does not cover; Flower's DP wrappers clip every update instead")
    if cfg.evaluation != "central":
        raise ConfigError(f"run-config key 'evaluation': {cfg.evaluation!r} publishes each round's client metrics, "
                          "which the DP account does not cover; use evaluation='central'")
    if cfg.refine not in ("auto", "none"):
        raise ConfigError(f"run-config key 'strategy-options.refine': {cfg.refine!r} refines the aggregate with the clients' models or "
                          "class counts, which the DP account does not cover")


def _check_zoo_model(cfg: RunConfig) -> None:
    """A zoo model (``model='torchvision:<name>'`` / ``'timm:<name>'``; its name is checked with the allowed values)
    has its own size (``model-width`` / ``model-depth`` 0), width tiers only (copies narrowed along the reader's
    groups; no depth tiers), and takes images."""
    if not is_zoo_name(cfg.model):
        return
    for key in ("model-width", "model-depth"):
        value = getattr(cfg, key.replace("-", "_"))
        if value != 0:
            raise ConfigError(f"run-config key {path_of(key)!r} ({value}): zoo model {cfg.model!r} has its own size; {key} "
                              f"sizes fedfuse's own models ({', '.join(MODELS)}) only; remove it (0)")
    if cfg.client_tiers.strip():
        try:
            depths = [d for _, d in parse_tier_pairs(cfg.client_tiers)]
        except ValueError:
            depths = []   # the tier syntax is checked with the key itself
        if any(d != 1.0 for d in depths):
            raise ConfigError(f"run-config key 'client-tiers' ({cfg.client_tiers!r}): depth tiers build fedfuse's own "
                              f"models at other depths; zoo model {cfg.model!r} takes width tiers only (narrowed "
                              f"copies), e.g. '1,0.5'; or use one of {list(MODELS)}")
    info = dataset_info(cfg.dataset)
    problem = zoo_input_problem(cfg.model, info.input_shape) if info is not None else None
    if problem:
        raise ConfigError(f"run-config key 'model': {problem} (dataset {cfg.dataset!r})")


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run's folder inside ``output-dir`` (``None`` when it can): ``<output-dir>/<run-name>``
    is one folder, so a path separator, ``.`` or ``..`` would write elsewhere (``'../escape'``: beside output-dir)."""
    if not name:
        return None
    if name in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")):
        return ("must be a single folder name (no '/' or '\\', not '.' or '..'): <output-dir>/<run-name> would not be "
                "a folder of its own inside output-dir; to write elsewhere, set output-dir")
    return None


def _check_rules(cfg: RunConfig) -> None:
    """Rules between keys and the dataset facts known without loading it."""
    _check_zoo_model(cfg)
    if cfg.resume and not cfg.run_name:
        raise ConfigError("run-config key 'resume' needs a fixed 'run-name' (the run to continue lives in "
                          "<output-dir>/<run-name>)")
    problem = run_name_problem(cfg.run_name)
    if problem:
        raise ConfigError(f"run-config key 'run-name' ({cfg.run_name!r}): {problem}")
    if cfg.tofu_r > 0 and cfg.model != "vit":
        raise ConfigError(f"run-config key 'client-options.tofu-r': Token Fusion applies to model 'vit' only, not {cfg.model!r}")
    if cfg.min_train_nodes > cfg.num_clients:
        raise ConfigError(f"run-config key 'strategy-options.min-train-nodes' ({cfg.min_train_nodes}) exceeds 'num-clients' "
                          f"({cfg.num_clients})")
    if not (cfg.device in ("auto", "cpu", "cuda") or (cfg.device.startswith("cuda:") and cfg.device[5:].isdigit())):
        raise ConfigError(f"run-config key 'device': {cfg.device!r} is not auto, cpu, cuda or cuda:N")
    if cfg.mode == "one-shot" and cfg.num_server_rounds != 1:
        # one-shot fusion is one round by definition; say so rather than silently overriding
        raise ConfigError("run-config key 'num-server-rounds' must be 1 when 'mode' is 'one-shot'")
    f = cfg.num_malicious_nodes
    (a, b), need = _min_replies(cfg), robust_min_replies(cfg)
    if a > 1 and cfg.min_train_nodes < need:   # Bulyan
        raise ConfigError(f"run-config key 'strategy-options.min-train-nodes' ({cfg.min_train_nodes}): strategy {cfg.strategy!r} needs "
                          f"at least {a}f + {b} = {need} replies a round (Flower's "
                          f"{strategy_spec(cfg.strategy).flower_class}, f = {f}: 'strategy-options.num-malicious-nodes')")
    if a == 1 and cfg.min_train_nodes < need:   # Krum, MultiKrum
        raise ConfigError(f"run-config key 'strategy-options.num-malicious-nodes' ({f}): Krum scores each model by its n - f - 2 nearest "
                          f"others, so it needs at least f + {b} = {need} replies a round; 'strategy-options.min-train-nodes' is "
                          f"{cfg.min_train_nodes}")
    if key_applies("num-nodes-to-select", cfg.strategy) and cfg.num_nodes_to_select > cfg.min_train_nodes:
        raise ConfigError(f"run-config key 'strategy-options.num-nodes-to-select' ({cfg.num_nodes_to_select}) is more than the "
                          f"{cfg.min_train_nodes} replies a round ('strategy-options.min-train-nodes')")
    if cfg.robust:
        if cfg.strategy in FLOWER_BASELINE_STRATEGIES:
            raise ConfigError(f"run-config key 'robust' applies to fedfuse's own strategies, not Flower's "
                              f"{cfg.strategy!r} (which aggregates the replies with its own code); choose a robust "
                              "Flower strategy (fedmedian, fedtrimmedavg, krum, multikrum, bulyan) instead")
        if cfg.client_tiers.strip():
            raise ConfigError("run-config key 'robust' does not take 'client-tiers' yet: the screen compares "
                              "every reply with the global model, and tier replies have other widths")
    if cfg.secure_aggregation:
        if not cfg.head_round:
            raise ConfigError("run-config key 'head-options.secure-aggregation' sums the head round's statistics: set "
                              "head-round=true (the training rounds' models are not sums Flower's SecAgg+ can carry "
                              "with fedfuse's checks)")
        if cfg.client_tiers.strip():
            raise ConfigError("run-config key 'head-options.secure-aggregation': the secure sum carries one classifier's "
                              "statistics; capacity tiers solve several")
        if cfg.num_clients < 2:
            raise ConfigError("run-config key 'head-options.secure-aggregation' needs at least 2 clients ('num-clients')")
    if cfg.head_ridge != SCHEMA["head-ridge"].default and not cfg.head_round:
        raise ConfigError("run-config key 'head-options.ridge' applies to head-round=true only")
    if cfg.head_solver != SCHEMA["head-solver"].default and not cfg.head_round:
        raise ConfigError("run-config key 'head-options.solver' applies to head-round=true only")
    if cfg.head_ridge != SCHEMA["head-ridge"].default and cfg.head_solver == "lda":
        raise ConfigError("run-config key 'head-options.ridge' is the ridge head's; head-options.solver='lda' does not read it")
    if cfg.mode == "one-shot" and not cfg.client_references:
        raise ConfigError("run-config key 'report-options.client-references': false applies to multi-round and warm-start runs; "
                          "mode='one-shot' takes its reference rows from 'report-options.one-shot-references' (set it to 'none')")
    if cfg.mode != "one-shot" and cfg.one_shot_references != SCHEMA["one-shot-references"].default:
        raise ConfigError(f"run-config key 'report-options.one-shot-references' ({cfg.one_shot_references!r}) applies to "
                          f"mode='one-shot' only, not {cfg.mode!r}; leave it unset")
    if cfg.evaluation == "federated" and cfg.test_set_path:
        raise ConfigError("run-config key 'data-options.test-set-path' is read by central evaluation only, but evaluation="
                          "'federated'; use evaluation='both' or leave data-options.test-set-path empty")
    if cfg.evaluation != "central" and cfg.val_fraction == 0:
        raise ConfigError(f"run-config key 'evaluation': {cfg.evaluation!r} evaluates on the clients' validation "
                          "splits, but data-options.val-fraction=0 holds none out; set data-options.val-fraction > 0 or evaluation='central'")
    _check_privacy(cfg)
    if cfg.partition_files:
        _check_partition_rules(cfg)
    _check_warm_start(cfg)
    fusion_options_dict(cfg)  # fails here, naming the key, if the string is not a TOML inline table
    _check_tiers(cfg)
    _check_depth_tiers(cfg)
    info = dataset_info(cfg.dataset)
    if info is not None and cfg.partitioning == "shards":
        if cfg.classes_per_client > info.num_classes:
            raise ConfigError(f"run-config key 'data-options.classes-per-client' ({cfg.classes_per_client}) exceeds the "
                              f"{info.num_classes} classes of dataset {cfg.dataset!r}")
        if cfg.classes_per_client == 0 and cfg.num_clients > info.num_classes:
            raise ConfigError(f"run-config key 'num-clients': class-disjoint 'shards' gives each client whole "
                              f"classes, but {cfg.num_clients} clients > {info.num_classes} classes of "
                              f"{cfg.dataset!r}; set data-options.classes-per-client > 0 or use fewer clients")


WARM_START_KEYS = ("warm-start-epochs", "warm-start-lr", "warm-start-fusion", "warm-start-fusion-options")


def _check_warm_start(cfg: RunConfig) -> None:
    """``mode='warm-start'``: at least one round after the fused one, a ``warm-start-fusion`` that returns one model of
    the global architecture and can run on this setup, no capacity tiers; the warm-start keys are not set for another
    mode, and ``initial-model-path`` is not set where round 1 ignores the global model."""
    if cfg.mode != "warm-start":
        for key in WARM_START_KEYS:
            if getattr(cfg, key.replace("-", "_")) != SCHEMA[key].default:
                raise ConfigError(f"run-config key {path_of(key)!r} applies to mode='warm-start' only, not {cfg.mode!r}; "
                                  "remove it or set mode='warm-start'")
        if cfg.mode == "one-shot" and cfg.initial_model_path:
            raise ConfigError("run-config key 'initial-model-path': one-shot clients train independently initialised "
                              "models and ignore the global model; remove it or use mode='multi-round'")
        return
    if cfg.num_server_rounds < 2:
        raise ConfigError("run-config key 'num-server-rounds' must be >= 2 when 'mode' is 'warm-start' (round 1 fuses "
                          "the clients' own models, multi-round FL continues from round 2); for a single fused round "
                          "use mode='one-shot'")
    if cfg.initial_model_path:
        raise ConfigError("run-config key 'initial-model-path': with mode='warm-start' round 1 starts from the clients' "
                          "own models and ignores the global model; remove it or use mode='multi-round'")
    if cfg.depth_tiers:   # the depth-tier strategy combines the clients' own models (fedfuse.flower.aggregators.warm_start)
        if cfg.warm_start_fusion not in DEPTH_WARM_START or cfg.warm_start_fusion_options_table:
            raise ConfigError(f"run-config key 'warm-start-options.fusion': with depth tiers the clients' own models are "
                              f"combined across depths by one of {list(DEPTH_WARM_START)} without options "
                              f"(warm-start-options.fusion-options=''), got {cfg.warm_start_fusion!r}")
        if cfg.warm_start_fusion == "ot" and min(cfg.depth_tier_widths) < 1:
            raise ConfigError("run-config key 'warm-start-options.fusion': 'ot' aligns models of one width; width x depth "
                              "tiers take 'feddf'")
        return
    if cfg.client_tiers:
        raise ConfigError("run-config key 'client-tiers': mode='warm-start' fuses models of the global architecture "
                          "only (or, with depth tiers, combines them across depths); remove the width tiers")
    _check_warm_start_fusion(cfg)


def _fusion_registry():
    """``(METHOD_SPECS, FusionError)`` of ``fedfuse.fusion``, for the method checks: the one place this module
    imports ``fedfuse.fusion``, on first use."""
    from fedfuse.fusion import METHOD_SPECS, FusionError  # deferred: +30% on `import fedfuse.config` (scipy, methods)

    return METHOD_SPECS, FusionError


def _model_family(cfg: RunConfig) -> tuple[str | None, bool | None]:
    """``(family, affine_levels)`` of ``cfg.model`` for ``MethodSpec.check_setup``: fedfuse's own models' from
    ``MODEL_FAMILIES``; ``(None, None)`` (unknown: not checked) for a zoo model, whose structure ``check_model``
    reads from the built model (``_check_zoo_setup``)."""
    family = MODEL_FAMILIES.get(cfg.model)
    return family, (family == "sequential" if family else None)


def warm_start_fusions() -> tuple[str, ...]:
    """The values of ``warm-start-fusion``: every fusion method whose result is one model of the models'
    architecture, and ``best-client``."""
    METHOD_SPECS, _ = _fusion_registry()

    return tuple(sorted(n for n, s in METHOD_SPECS.items() if s.same_architecture)) + (BEST_CLIENT,)


def _check_warm_start_fusion(cfg: RunConfig) -> None:
    """``warm-start-fusion`` names a method that can fuse this run's clients (count, model family, fusion set)."""
    fusion, options = cfg.warm_start_fusion, cfg.warm_start_fusion_options_table
    if fusion == BEST_CLIENT:   # needs fusion labels: checked by the ServerApp once the fusion set is loaded
        if options:
            raise ConfigError("run-config key 'warm-start-options.fusion-options': warm-start-options.fusion='best-client' fuses "
                              f"nothing and takes no options, got {options}; set warm-start-options.fusion-options=''")
        return
    METHOD_SPECS, FusionError = _fusion_registry()

    names = warm_start_fusions()
    if fusion not in names:
        close = difflib.get_close_matches(fusion, list(names), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"run-config key 'warm-start-options.fusion': {fusion!r} is not a fusion method that returns one "
                          f"model of the clients' architecture{hint}; choose one of {list(names)}")
    try:
        METHOD_SPECS[fusion].parse_options(options)
    except FusionError as exc:
        default = SCHEMA["warm-start-fusion-options"].default
        hint = (f" (the default {default!r} is for {SCHEMA['warm-start-fusion'].default!r}; set "
                "warm-start-fusion-options='' for the method's defaults)"
                if cfg.warm_start_fusion_options == default else "")
        raise ConfigError(f"run-config key 'warm-start-options.fusion-options': {exc}{hint}") from None
    family, affine = _model_family(cfg)
    problem = fusion_set_problem(cfg)
    try:
        METHOD_SPECS[fusion].check_setup(num_models=clients_per_round(cfg), family=family,
                                         has_fusion_set=problem is None, affine_levels=affine)
    except FusionError as exc:
        raise ConfigError(f"run-config key 'warm-start-options.fusion': {exc}" + (f", but {problem}" if problem else "")
                          ) from None


PARTITION_ID = "{partition-id}"


def partition_file(cfg: RunConfig, partition_id: int) -> str:
    """The file of client ``partition_id`` under ``partition-files``."""
    return cfg.partition_files.replace(PARTITION_ID, str(int(partition_id)))


def _check_partition_rules(cfg: RunConfig) -> None:
    """``partition-files``: the pattern names each client's file, the dataset's shape is known without loading it,
    and the server has its own test set (central evaluation)."""
    if PARTITION_ID not in cfg.partition_files:
        raise ConfigError(f"run-config key 'data-options.partition-files': {cfg.partition_files!r} has no {PARTITION_ID} "
                          f"placeholder; write e.g. '/abs/dir/node-{PARTITION_ID}.npz'")
    if dataset_info(cfg.dataset) is None:
        raise ConfigError(f"run-config key 'data-options.partition-files' needs a dataset whose input shape and classes are known "
                          f"without loading it (the files' preprocessing); {cfg.dataset!r} is not one")
    if cfg.evaluation != "federated" and not cfg.test_set_path:
        raise ConfigError("run-config key 'data-options.partition-files': the clients' files are all the training data, so central "
                          "evaluation needs data-options.test-set-path (or evaluation='federated')")
    if cfg.fusion_set_source != "public":
        raise ConfigError("run-config key 'fusion-set-source': with data-options.partition-files the fusion set is drawn from "
                          "fusion-set-path (a public pool); leave fusion-set-source='public'")


def ordered_dropout_draw(cfg: RunConfig) -> str | float:
    """``ordered-dropout-draw`` as the strategy's ``ordered_dropout_draw`` (a number as a float); ``ConfigError``
    naming the key for anything but auto, uniform, width or a probability in (0, 1)."""
    text = cfg.ordered_dropout_draw
    if text == "auto" or text in ORDERED_DROPOUT_DRAWS:
        return text
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < 1:
        raise ConfigError(f"run-config key 'tier-options.ordered-dropout-draw': 'auto', 'uniform', 'width', 'sandwich' or a "
                          f"probability in (0, 1), got {text!r}")
    return value


def _check_tiers(cfg: RunConfig) -> None:
    """``client-tiers`` parses, and the strategy can aggregate clients of different widths."""
    tiers = cfg.tiers
    narrow = min(tiers or cfg.depth_tier_widths or (1.0,)) < 1   # width tiers or width x depth tiers
    if ordered_dropout_draw(cfg) not in ("auto", "uniform"):
        if not narrow or cfg.ordered_dropout == "off":
            raise ConfigError("run-config key 'tier-options.ordered-dropout-draw': needs capacity tiers with ordered dropout "
                              "(client-tiers with a width below 1, tier-options.ordered-dropout not 'off')")
    if not tiers or len(set(tiers)) == 1 and tiers[0] == 1:
        if cfg.ordered_dropout in ("all", "narrow") and not narrow:
            raise ConfigError("run-config key 'tier-options.ordered-dropout': needs capacity tiers (client-tiers with a width "
                              "below 1), there is no narrower sub-model to train")
        return
    tier_models = resolve_tier_models(cfg.strategy, cfg.tier_models, MODEL_FAMILIES.get(cfg.model))
    if cfg.strategy in TIER_STRATEGIES and tier_models != "slice":
        raise ConfigError(f"run-config key 'tier-options.models': strategy {cfg.strategy!r} derives tier models by slicing "
                          f"only (its paper's sub-models); {tier_models!r} needs a fusion strategy, e.g. "
                          "strategy='average'")
    if cfg.strategy in TIER_STRATEGIES + SUBMODEL_METHODS:   # sub-model averaging (+ FedDF's distillation)
        if tier_models == "fuse":
            raise ConfigError(f"run-config key 'tier-options.models': strategy {cfg.strategy!r} averages sub-models and "
                              "derives tier models by slicing; use tier-options.models='slice'")
        return
    METHOD_SPECS, _ = _fusion_registry()

    spec = METHOD_SPECS.get(cfg.strategy)
    if spec is None or cfg.strategy in NON_FUSION_STRATEGIES or not spec.mixed_widths:
        able = sorted(TIER_STRATEGIES + tuple(n for n, s in METHOD_SPECS.items() if s.mixed_widths and s.any_target))
        raise ConfigError(f"run-config key 'client-tiers': strategy {cfg.strategy!r} cannot aggregate clients of "
                          f"different widths; use one of {able}")
    if tier_models == "fuse" and not spec.any_target:
        raise ConfigError(f"run-config key 'tier-options.models': 'fuse' needs a fusion method that builds into another width "
                          f"(fuse(..., target=)); {cfg.strategy!r} cannot, use tier-options.models='slice'")


DEPTH_TIER_METHODS = DEPTH_METHODS   # the registry's (fedfuse.flower.tiers.depth_tiers reads the same)


def _check_depth_tiers(cfg: RunConfig) -> None:
    """Depth tiers (``client-tiers`` ``<width>x<depth>``): a strategy that aggregates across depths, a model with at
    least 2 depth units, none of the width-tier keys; a depth-tier baseline without depth tiers fails."""
    depths = cfg.depth_tiers
    if not depths:
        if cfg.strategy in DEPTH_TIER_STRATEGIES:
            raise ConfigError(f"run-config key 'client-tiers': strategy {cfg.strategy!r} needs depth tiers "
                              "(<width>x<depth> entries, e.g. client-tiers='1x1,1x0.75,1x0.5,1x0.25')")
        return
    if cfg.strategy not in DEPTH_TIER_METHODS:
        raise ConfigError(f"run-config key 'client-tiers': strategy {cfg.strategy!r} cannot aggregate clients of "
                          f"different depths; use one of {list(DEPTH_TIER_METHODS)}")
    if any(w < 1 for w in cfg.depth_tier_widths) and cfg.strategy not in WIDTH_DEPTH_TIER_METHODS:
        raise ConfigError(f"run-config key 'strategy': {cfg.strategy!r} cannot aggregate width x depth tiers "
                          f"(client-tiers {cfg.client_tiers!r} has tiers narrower than the global model: "
                          "inclusivefl's momentum pairs layers of one width, ot aligns models of one width); use one "
                          f"of {list(WIDTH_DEPTH_TIER_METHODS)}")
    if cfg.model_depth < 2:
        raise ConfigError(f"run-config key 'client-tiers': depth tiers need a model with at least 2 blocks / hidden "
                          f"layers to keep fewer of; model-depth is {cfg.model_depth}")
    width_keys = (("tier-models", "auto"),) if min(cfg.depth_tier_widths) < 1 else \
        (("tier-models", "auto"), ("ordered-dropout", "auto"))   # width x depth tiers take ordered dropout
    for key, default in width_keys:
        if getattr(cfg, key.replace("-", "_")) != default:
            raise ConfigError(f"run-config key {path_of(key)!r}: a width-tier option; depth tiers at full width take none "
                              f"(leave it {default!r})")
    if cfg.refine not in ("auto", "none"):
        raise ConfigError(f"run-config key 'strategy-options.refine': {cfg.refine!r} refines one classifier; a depth-tier model has "
                          "one per depth (feddf and ot distil into every exit): leave it 'auto'")


def fusion_options_dict(cfg: RunConfig) -> dict[str, Any]:
    """``fusion-options`` (a TOML inline table, e.g. ``"{ridge=1e-3, head_weights=true}"``) as a dict (a copy of
    the value ``RunConfig`` parsed once)."""
    return dict(cfg.fusion_options_table)


def _parse_fusion_options(text: str, key: str = "fusion-options") -> dict[str, Any]:
    import tomllib

    text = text.strip()
    if not text:
        return {}
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"run-config key {path_of(key)!r}: not a TOML inline table ({exc}): {text!r}; "
                          "write e.g. \"{ridge=1e-3, solver='sinkhorn'}\"") from None
    if not isinstance(value, dict):
        raise ConfigError(f"run-config key {path_of(key)!r}: expected an inline table like '{{ridge=1e-3}}', "
                          f"got {text!r}")
    return value


# -------------------------------------------------------------------------------- method / setup checks
def strategy_names() -> tuple[str, ...]:
    """Every strategy name (``fedfuse.strategy_specs``): FedAvg, Flower's baselines, the tier baselines and every
    fusion method whose result keeps the global architecture."""
    return registry_names()


def clients_per_round(cfg: RunConfig) -> int:
    """Clients Flower's FedAvg samples per round: ``max(int(fraction-train · num-clients), min-train-nodes)``."""
    return min(cfg.num_clients, max(int(cfg.num_clients * cfg.fraction_train), cfg.min_train_nodes))


def fusion_set_problem(cfg: RunConfig) -> str | None:
    """Why the server will have no fusion set under ``cfg`` (``None`` when it will have one)."""
    if cfg.fusion_set_path or cfg.fusion_set_source == "client0":
        return None
    if cfg.partition_files:
        return ("with partition-files the server's fusion set comes only from fusion-set-path, which is not set; "
                "give it a public pool (e.g. ../shared/anchors/splits/mnist1d-public.npz)")
    if cfg.public_fraction <= 0:
        return ("fusion-set-source='public' with public-fraction=0 holds no samples and no fusion-set-path is "
                "given; set data-options.public-fraction > 0, fusion-set-source='client0' or fusion-set-path")
    return None


def _strategy_method(strategy: str) -> str | None:
    """The fusion method a strategy's rounds run (its registry entry's ``method``): ``None`` for the strategies that
    are no fusion method themselves (FedAvg, Flower's baselines, ``auto``: the clients' vote between candidates, not
    the label-free fusion method ``fuse("auto", ...)``); a name the registry does not know is its own method."""
    try:
        return strategy_spec(strategy).method
    except ValueError:
        return strategy


def _check_method(cfg: RunConfig, strategies: tuple[str, ...]) -> None:
    METHOD_SPECS, FusionError = _fusion_registry()
    if cfg.strategy not in strategies:
        close = difflib.get_close_matches(cfg.strategy, list(strategies), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = (f"{cfg.strategy!r} is a fusion method of the library (fuse({cfg.strategy!r}, models, ...)) whose "
                "result is not one model of the clients' architecture, so it cannot be a round's global model "
                "(docs/methods.md)" if cfg.strategy in METHOD_SPECS else f"unknown strategy {cfg.strategy!r}{hint}")
        raise ConfigError(f"run-config key 'strategy': {what}; choose one of {sorted(strategies)}")
    if strategy_spec(cfg.strategy).one_shot_only:   # the global model is not one model of the clients' architecture
        if cfg.mode != "one-shot":
            raise ConfigError(f"run-config key 'strategy': {cfg.strategy!r} keeps every client's model in the global "
                              f"model, which the clients cannot train in a next round; it needs mode='one-shot' "
                              f"(got mode={cfg.mode!r})")
        if cfg.secure_aggregation:
            raise ConfigError(f"run-config key 'secure-aggregation': strategy {cfg.strategy!r} does not take it yet "
                              "(its head round's statistics are not masked); use another strategy or turn it off")
        if cfg.client_tiers:
            raise ConfigError(f"run-config key 'client-tiers': strategy {cfg.strategy!r} keeps every client's model as "
                              "it is (of any width), so it has no tier models to send; leave 'client-tiers' empty")

    options = fusion_options_dict(cfg)
    spec = METHOD_SPECS.get(_strategy_method(cfg.strategy))
    if spec is None or cfg.strategy in NON_FUSION_STRATEGIES + TIER_STRATEGIES + DEPTH_TIER_STRATEGIES:
        if cfg.refine not in ("auto", "none"):
            what = ("chooses between candidate aggregations" if cfg.strategy in SELECTING_STRATEGIES else
                    "aggregates the arrays only")
            raise ConfigError(f"run-config key 'strategy-options.refine': strategy {cfg.strategy!r} {what} and "
                              f"takes no refinement, got {cfg.refine!r}; use a fusion strategy such as 'average'")
        if options:
            raise ConfigError(f"run-config key 'fusion-options': {no_fusion_options(cfg.strategy, options)}")
        return
    try:
        spec.parse_options(options)
    except FusionError as exc:
        raise ConfigError(f"run-config key 'fusion-options': {exc}") from None
    n = clients_per_round(cfg)
    try:
        spec.check_setup(num_models=n)
    except FusionError as exc:
        raise ConfigError(f"run-config keys 'strategy'/'num-clients': {exc} ({n} clients per round from "
                          f"num-clients={cfg.num_clients}, strategy-options.fraction-train={cfg.fraction_train}, "
                          f"min-train-nodes={cfg.min_train_nodes})") from None
    family, affine = _model_family(cfg)
    try:
        spec.check_setup(num_models=n, family=family, affine_levels=affine)
    except FusionError as exc:
        raise ConfigError(f"run-config keys 'strategy'/'model': {exc} (model {cfg.model!r} is of the {family} "
                          "family)") from None
    problem = fusion_set_problem(cfg)
    if problem is not None and cfg.refine not in ("auto", "none"):
        raise ConfigError(f"run-config key 'strategy-options.refine': refine={cfg.refine!r} needs the server fusion set, but {problem}")
    try:
        spec.check_setup(num_models=n, has_fusion_set=problem is None)
    except FusionError as exc:
        raise ConfigError(f"run-config key 'strategy': {exc}, but {problem}") from None


def _check_candidate_setup(cfg: RunConfig) -> None:
    """Every fusion method the user named in ``auto-candidates`` can run on this setup (clients per round, model
    family, a fusion set): otherwise auto skipped it every round, with a warning per round and no error."""
    METHOD_SPECS, FusionError = _fusion_registry()

    n = clients_per_round(cfg)
    family, affine = _model_family(cfg)
    # every round takes an array candidate: no fusion candidate is built, so none reads a fusion set
    problem = fusion_set_problem(cfg) if auto_round_aggregation(cfg) is None else None
    for name in auto_candidates(cfg):
        spec = METHOD_SPECS.get(name)
        if name in ARRAY_CANDIDATES or spec is None:
            continue
        try:
            spec.check_setup(num_models=n, family=family, has_fusion_set=problem is None,
                             affine_levels=affine)
        except FusionError as exc:
            why = (f"{n} clients per round from num-clients={cfg.num_clients}, strategy-options.fraction-train={cfg.fraction_train}, "
                   f"min-train-nodes={cfg.min_train_nodes}; model {cfg.model!r}" + (f"; {problem}" if problem else ""))
            raise ConfigError(f"run-config key 'strategy-options.auto-candidates': candidate {name!r} cannot run on this setup: {exc} "
                              f"({why}); auto would skip it every round. Remove it or change the setup") from None


def _check_strategy_keys(cfg: RunConfig) -> None:
    """Keys only some strategies read (``fedfuse.strategy_specs.STRATEGY_KEYS``) must not be set for another one, and
    Flower's baselines are not fusion methods (no ``fusion-rounds``)."""
    if cfg.momentum != SCHEMA["momentum"].default and cfg.optimizer != "sgd":
        raise ConfigError(f"run-config key 'client-options.momentum' ({cfg.momentum}) applies to optimizer='sgd' only, not "
                          f"{cfg.optimizer!r}; remove it or set optimizer='sgd'")
    if -1 < cfg.server_momentum < 0:
        raise ConfigError(f"run-config key 'strategy-options.server-momentum': {cfg.server_momentum} is neither -1 (the strategy's "
                          "default) nor in [0, 1)")
    for key, users in STRATEGY_KEYS.items():
        if getattr(cfg, key.replace("-", "_")) != SCHEMA[key].default and not key_applies(key, cfg.strategy):
            raise ConfigError(f"run-config key {path_of(key)!r} applies to strategy {' | '.join(users)} only, not "
                              f"{cfg.strategy!r}; remove it or choose one of those strategies")
    if cfg.align_to != SCHEMA["align-to"].default:
        METHOD_SPECS, _ = _fusion_registry()

        able = sorted(n for n, sp in METHOD_SPECS.items() if sp.any_reference)
        spec = METHOD_SPECS.get(cfg.strategy)
        if spec is None or not spec.any_reference:
            raise ConfigError(f"run-config key 'strategy-options.align-to': {cfg.align_to!r} applies to the strategies that align "
                              f"units ({' | '.join(able)}), not {cfg.strategy!r}")
        if cfg.mode == "one-shot":
            raise ConfigError("run-config key 'strategy-options.align-to': 'global' needs a global model the clients trained from; "
                              "in mode='one-shot' they start from independent initialisations")
    for key in ("auto-candidates", "auto-fusion-epochs", "auto-momentum"):
        if getattr(cfg, key.replace("-", "_")) != SCHEMA[key].default and cfg.strategy not in SELECTING_STRATEGIES:
            raise ConfigError(f"run-config key {path_of(key)!r} applies to strategy 'auto' only, not {cfg.strategy!r}")
    if cfg.strategy in SELECTING_STRATEGIES:
        try:
            check_candidates(cfg.auto_candidate_names)
        except ValueError as exc:
            raise ConfigError(f"run-config key 'strategy-options.auto-candidates': {exc}") from None
        _check_candidate_setup(cfg)
        if cfg.mode != "one-shot" and cfg.local_epochs < cfg.auto_fusion_epochs and all(c not in ARRAY_CANDIDATES
                                                             for c in cfg.auto_candidate_names):
            raise ConfigError(f"run-config key 'strategy-options.auto-fusion-epochs': {cfg.auto_fusion_epochs} > local-epochs "
                              f"{cfg.local_epochs} turns fusion candidates off, and strategy-options.auto-candidates has only fusions")
        if cfg.auto_momentum != SCHEMA["auto-momentum"].default and auto_round_aggregation(cfg) is None:
            raise ConfigError(f"run-config key 'strategy-options.auto-momentum': {cfg.auto_momentum!r} applies to multi-round runs below "
                              f"auto-fusion-epochs (local-epochs {cfg.local_epochs}, strategy-options.auto-fusion-epochs "
                              f"{cfg.auto_fusion_epochs}, mode {cfg.mode!r}): there the clients' vote picks the step")
        if cfg.auto_momentum == "on" and not any(c in MEAN_METHODS for c in cfg.auto_candidate_names):
            raise ConfigError("run-config key 'strategy-options.auto-momentum': 'on' takes the 'average' candidate (the momentum step), "
                              f"which strategy-options.auto-candidates {cfg.auto_candidates!r} does not list")
    if cfg.strategy in FLOWER_BASELINE_STRATEGIES and cfg.fusion_rounds:
        raise ConfigError(f"run-config key 'strategy-options.fusion-rounds': strategy {cfg.strategy!r} is Flower's own, not a fusion "
                          "method; set strategy-options.fusion-rounds=0")
    if cfg.mode == "one-shot" and cfg.fusion_rounds:
        raise ConfigError(f"run-config key 'strategy-options.fusion-rounds' ({cfg.fusion_rounds}): mode='one-shot' has one round, and it "
                          "fuses; strategy-options.fusion-rounds (fuse in rounds 1..N, average afterwards) changes nothing there; "
                          "set strategy-options.fusion-rounds=0")


# ------------------------------------------------------------------------------------- files and model
def dataset_info(dataset: str):
    """``fedfuse.data.sources.SourceInfo`` of ``dataset`` (shape, classes, scale) or ``None`` when it is only
    known after loading (``hf:<name>``)."""
    return source_info(dataset)


def check_files(cfg: RunConfig, *, input_shape: tuple[int, ...] | None = None,
                num_classes: int | None = None) -> None:
    """Check the files ``cfg`` names; ``ConfigError`` naming the key and the path.

    - ``fusion-set-path``: exists, is a readable ``.pt``/``.pth``/``.npz``, holds a floating-point input tensor of at
      least 2 samples ``[B, *input_shape]`` (``fusion-set-size``'s minimum: FedDF's held-out split needs one on each
      side) with finite values on the dataset's scale (and, when present, labels ``[B]`` in ``[0, num_classes)``).
    - ``data-root``: an existing directory when set; required by the torchvision datasets (CIFAR); MNIST and
      Fashion-MNIST need their idx files in it or, without it, Debian's package (or a download host that answers).
    - ``partition-files``: every client's file exists and is valid node-local data for the dataset.

    ``input_shape`` / ``num_classes`` override the dataset metadata (the ServerApp passes the loaded
    data's; needed for ``hf:<name>``, whose shape is unknown before loading).
    """
    if cfg.data_root:
        from pathlib import Path

        if not Path(cfg.data_root).expanduser().is_dir():
            raise ConfigError(f"run-config key 'data-root': {cfg.data_root!r} is not a directory")
    if cfg.dataset in IDX_SOURCES and not (cfg.partition_files and cfg.fusion_set_path and cfg.test_set_path):
        problem = idx_files_problem(cfg.dataset, cfg.data_root)   # (with all three files no process loads it)
        if problem:
            raise ConfigError(f"run-config key 'data-root': {problem}")
    elif cfg.dataset in TORCHVISION_SOURCES and not cfg.data_root:
        raise ConfigError(f"run-config key 'data-root': dataset {cfg.dataset!r} is read from a torchvision root "
                          "directory; set data-root to it")
    if cfg.fusion_set_path:
        read_fusion_set(cfg.fusion_set_path, dataset=cfg.dataset, input_shape=input_shape, num_classes=num_classes)
    if cfg.test_set_path:
        read_fusion_set(cfg.test_set_path, dataset=cfg.dataset, input_shape=input_shape, num_classes=num_classes,
                        key="test-set-path")
    if cfg.partition_files:
        info = dataset_info(cfg.dataset)
        for pid in range(cfg.num_clients):
            path = partition_file(cfg, pid)
            try:
                load_node_data(path, num_classes=info.num_classes, info=info, dataset=cfg.dataset,
                               val_fraction=cfg.val_fraction, seed=0)
            except ValueError as exc:
                raise ConfigError(f"run-config key 'data-options.partition-files': client {pid}'s file {path!r}: {exc}") from None


def read_fusion_set(path: str, *, dataset: str = "", input_shape: tuple[int, ...] | None = None,
                    num_classes: int | None = None, key: str = "fusion-set-path"):
    """The fusion set file of ``fusion-set-path``, checked against ``dataset`` (``check_files``' rules).

    Returns ``(x float32 [B, *input_shape], y int64 [B] or None)``; ``ConfigError`` naming the key and path.
    """
    try:
        x, y = load_fusion_file(path)
        check_fusion_inputs(x, y, dataset=dataset, info=dataset_info(dataset) if dataset else None,
                            input_shape=input_shape, num_classes=num_classes)
        if key == "test-set-path" and y is None:  # the same format; a test set needs its labels
            raise ValueError("holds no labels 'y'; a test set needs x and y")
        need = int(SCHEMA["fusion-set-size"].ge)
        if key == "fusion-set-path" and x.shape[0] < need:
            # as fusion-set-size: distillation (feddf, kd, refine=distill, auto's feddf candidate) holds part of the
            # set out to early-stop on and fits on the rest (fedfuse.fusion.distillation.holdout_split), alignment
            # standardises activations over samples; one sample failed only after round 1's training
            raise ValueError(f"holds {x.shape[0]} sample(s); a fusion set needs at least {need} (distillation holds "
                             "part of it out for early stopping and fits on the rest, alignment standardises "
                             "activations over samples)")
    except ValueError as exc:
        raise ConfigError(f"run-config key {path_of(key)!r} ({path}): {exc}") from None
    return x.float(), (y.long() if y is not None else None)


def check_model(cfg: RunConfig) -> None:
    """Build the model for the dataset's input shape and map a batch of two to logits (skipped when the shape
    is only known after loading)."""
    info = dataset_info(cfg.dataset)
    if info is None:
        return
    import torch

    zoo = is_zoo_name(cfg.model)
    # a zoo model's own code states its limits with any of these (timm: AssertionError on an input size)
    errors = (ValueError, RuntimeError, AssertionError, TypeError, IndexError) if zoo else (ValueError, RuntimeError)
    try:
        model = build_model(cfg.model, num_classes=info.num_classes, input_shape=info.input_shape,
                            width=cfg.model_width, depth=cfg.model_depth, seed=cfg.seed)
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, *info.input_shape))
    except errors as exc:
        size = "" if zoo else f" (width {cfg.model_width}, depth {cfg.model_depth})"
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0] if zoo else exc
        if zoo:
            detail = f"{detail} (zoo models see images of at least 32x32 pixels: fedfuse.models.zoo)"
        raise ConfigError(f"run-config key 'model': {cfg.model!r}{size} cannot take dataset {cfg.dataset!r} inputs "
                          f"{info.input_shape}: {detail}") from None
    if tuple(out.shape) != (2, info.num_classes):
        raise ConfigError(f"run-config key 'model': {cfg.model!r} maps inputs {info.input_shape} to "
                          f"{tuple(out.shape[1:])}, expected {info.num_classes} logits")
    if zoo:
        _check_zoo_setup(cfg, model)
    if cfg.initial_model_path:
        load_initial_model(cfg.initial_model_path, model)


def _check_zoo_setup(cfg: RunConfig, model: Any) -> None:
    """What the run asks of a zoo model's structure, read from the built ``model`` (``parse_run_config`` cannot
    know it without building): every fusion method the run uses (``strategy``, ``warm-start-fusion``, the
    ``auto-candidates`` named) can take it, and the head round can read its classifier. A method that never
    decomposes the models (``any_module``: averaging, distillation) takes any model."""
    METHOD_SPECS, FusionError = _fusion_registry()

    uses = []
    if cfg.strategy in METHOD_SPECS and cfg.strategy not in NON_FUSION_STRATEGIES:
        uses.append(("strategy", cfg.strategy))
    if cfg.mode == "warm-start" and cfg.warm_start_fusion in METHOD_SPECS:
        uses.append(("warm-start-fusion", cfg.warm_start_fusion))
    if cfg.strategy in SELECTING_STRATEGIES and cfg.auto_candidates != SCHEMA["auto-candidates"].default:
        uses += [("auto-candidates", c) for c in cfg.auto_candidate_names if c in METHOD_SPECS]
    if not uses and not cfg.head_round:
        return
    try:   # fedfuse.fusion.model_setup for one model: its adapter family and whether every level is affine
        family = model_family(model)
        affine, problem = all(lv.affine for lv in levels(model)), None
    except ValueError as exc:   # UnsupportedModelError: no structure reader takes this model
        family, affine, problem = None, None, str(exc).splitlines()[0]
    for key, name in uses:
        spec = METHOD_SPECS[name]
        if problem is not None and not spec.any_module:
            takes_any = sorted(n for n, sp in METHOD_SPECS.items() if sp.any_module)
            raise ConfigError(f"run-config key {path_of(key)!r}: fusion method {name!r} reads the models' structure, which "
                              f"fedfuse cannot read for model {cfg.model!r} ({problem}); use one that takes any "
                              f"model ({', '.join(takes_any)})")
        try:
            spec.check_setup(num_models=clients_per_round(cfg), family=family, affine_levels=affine)
        except FusionError as exc:
            raise ConfigError(f"run-config keys {path_of(key)!r}/'model': {exc} (model {cfg.model!r} is of the {family} "
                              "family)") from None
    if problem is not None and cfg.head_round:
        raise ConfigError(f"run-config key 'head-round': the head round solves the classifier on the model's "
                          f"features, which fedfuse cannot read for model {cfg.model!r} ({problem}); set "
                          "head-round=false")


def load_initial_model(path: str, model: Any, *, key: str = "run-config key 'initial-model-path'") -> dict[str, Any]:
    """The state dict in ``path`` (a ``.pt`` state dict: ``initial-model-path``, or a node's ``model-path``), loaded
    into ``model`` (strictly: same names and shapes, finite values) and returned; ``ConfigError`` naming ``key`` and
    the path."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ConfigError(f"{key} ({path}): cannot read a torch state dict: {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{key} ({path}): expected a state dict (name -> tensor), got "
                          f"{type(state).__name__}")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(f"{key} ({path}): does not fit the run's model "
                          f"{type(model).__name__}: {str(exc).splitlines()[0]}") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(f"{key} ({path}): non-finite values in {bad[:3]}")
    return model.state_dict()


def data_options(cfg: RunConfig, num_clients: int | None = None) -> dict[str, Any]:
    """The arguments of ``fedfuse.data.FederatedData.build`` for the run (every process builds the identical data
    from them): the one place that maps run-config keys to the data's options."""
    return {"dataset": cfg.dataset, "num_clients": num_clients or cfg.num_clients, "partitioning": cfg.partitioning,
            "alpha": cfg.dirichlet_alpha, "classes_per_client": cfg.classes_per_client,
            "fusion_size": cfg.fusion_set_size, "fusion_source": cfg.fusion_set_source,
            # the default size is an upper bound (a small dataset's whole pool, no warning); a size the user set warns
            "fusion_size_strict": cfg.fusion_set_size != SCHEMA["fusion-set-size"].default,
            "public_fraction": cfg.public_fraction, "root": cfg.data_root, "seed": cfg.seed,
            "test_fraction": cfg.test_fraction}


#: datasets generated or shipped in-process: their partitions are cheap to check before Flower starts
LOCAL_DATASETS = ("digits", "digits-flat", "digits-std", "mnist1d", "mnist1d-flat", "synthetic")


def check_partitions(cfg: RunConfig) -> None:
    """Every client's partition holds enough samples to train (and to keep a validation split when ``val-fraction``
    is set): ``ConfigError`` naming ``num-clients`` / ``partitioning`` and the smallest clients otherwise. Checked
    on the partitions the clients will build (``data_options``, deterministic) for the in-process
    datasets; ``partition-files`` are checked by ``check_files``, and remote datasets when the server loads them."""
    if cfg.partition_files or cfg.dataset not in LOCAL_DATASETS:
        return
    try:
        data = FederatedData.build(**data_options(cfg))
    except ValueError as exc:
        raise ConfigError(f"run-config key 'partitioning': {cfg.partitioning!r} over num-clients={cfg.num_clients} "
                          f"cannot be built: {exc}") from None
    need = 2 if cfg.val_fraction > 0 else 1   # a validation sample needs a training sample beside it
    sizes = [len(p) for p in data.partitions]
    small = [i for i, n in enumerate(sizes) if n < need]
    if small:
        shown = ", ".join(f"client {i}: {sizes[i]}" for i in small[:5]) + (" ..." if len(small) > 5 else "")
        raise ConfigError(f"run-config key 'num-clients': {cfg.num_clients} clients over {sum(sizes)} training "
                          f"samples with partitioning={cfg.partitioning!r} leaves {len(small)} client(s) with fewer "
                          f"than {need} samples ({shown}); use fewer clients or another partitioning "
                          f"(e.g. a larger dirichlet-alpha)")


@functools.lru_cache(maxsize=8)
def _parse_items(items: tuple[tuple[str, Any], ...]) -> RunConfig:
    return parse_run_config(dict(items))


def parse_once(run_config: Mapping[str, Any] | None) -> RunConfig:
    """``parse_run_config``, once per distinct run config: a ClientApp reads the run's config on every message, the
    parse (and its checks) runs on the first (``RunConfig`` is frozen, so the answer can be shared)."""
    items = tuple(sorted(dict(run_config or {}).items()))
    try:
        return _parse_items(items)
    except TypeError:   # an unhashable value: parse without the cache
        return parse_run_config(run_config)


def canonical(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``run_config`` in its canonical form (top-level keys and dotted option-table paths: what Flower is handed;
    ``fedfuse.config_layout.canonical_run_config``); unknown keys are kept for ``parse_run_config`` to name."""
    return canonical_run_config(run_config, top_level=TOP_LEVEL, error=ConfigError, note=ConfigNote)


def check_device(cfg: RunConfig) -> None:
    """``device='cuda'`` / ``'cuda:N'`` needs that CUDA device on this machine (the server evaluates on it, and in a
    simulation every client trains on it): ``ConfigError`` naming ``device`` before any process starts, not a failed
    run a minute later. ``'auto'`` takes CUDA when present and is never an error."""
    if not cfg.device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"run-config key 'device': {cfg.device!r}, but CUDA is not available on this machine "
                          f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use 'auto' (CUDA "
                          "when present) or 'cpu'")
    count = torch.cuda.device_count()
    index = int(cfg.device[5:]) if cfg.device.startswith("cuda:") else 0
    if index >= count:
        raise ConfigError(f"run-config key 'device': {cfg.device!r}, but this machine has {count} CUDA device(s) "
                          f"(cuda:0 to cuda:{count - 1})")


def output_root(output_dir: str) -> Path:
    """``output-dir`` as a run resolves it: relative to ``FEDFUSE_OUTPUT_ROOT`` or the working directory
    (``fedfuse.flower.server_app.output_dir``)."""
    base = Path(output_dir).expanduser()
    return base if base.is_absolute() else Path(os.environ.get("FEDFUSE_OUTPUT_ROOT", os.getcwd())) / base


def check_output_dir(cfg: RunConfig) -> None:
    """``output-dir`` is a folder this process can create and write in: its nearest existing ancestor is a folder in
    which a folder can be made (tried: an empty folder made and removed again; file permissions alone do not tell,
    e.g. for root under ``/proc``). ``ConfigError`` naming ``output-dir`` otherwise, before any process starts."""
    root = output_root(cfg.output_dir)
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a folder" if existing == root else f"cannot be created: {str(existing)!r} is a file"
        raise ConfigError(f"run-config key 'output-dir': {cfg.output_dir!r} {what}")
    try:
        Path(tempfile.mkdtemp(prefix=".fedfuse-write-check-", dir=existing)).rmdir()
    except OSError as exc:
        what = ("cannot be written in" if existing == root
                else f"cannot be created (making a folder in {str(existing)!r} fails)")
        raise ConfigError(f"run-config key 'output-dir': {cfg.output_dir!r} {what}: {exc.strerror or exc}") from None


def preflight(run_config: Mapping[str, Any] | None, *, known_strategies: tuple[str, ...] | None = None) -> RunConfig:
    """Everything knowable from the config, before any Flower process: ``parse_run_config``, ``check_device``,
    ``check_output_dir``, ``check_files``, ``check_model``, ``check_partitions``. Raises ``ConfigError`` naming the
    key."""
    cfg = parse_run_config(run_config, known_strategies=known_strategies)
    check_device(cfg)
    check_output_dir(cfg)
    check_files(cfg)
    check_model(cfg)
    check_partitions(cfg)
    return cfg


def describe() -> str:
    """The schema as a markdown table (key, type, default, allowed values / range, meaning)."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    order = list(TOP_LEVEL) + [key for entries in OPTION_TABLES.values() for key in entries.values()]
    for s in (SCHEMA[key] for key in order):
        allowed = " \\| ".join(s.choices) if s.choices else s.range_text()
        if s.key == "dataset":
            allowed += f" \\| {HF_PREFIX}<name>"
        if s.key == "model":
            allowed += " \\| torchvision:<name> \\| timm:<name>"
        if s.key == "strategy":
            allowed = " \\| ".join(strategy_names())
        if s.key == "warm-start-fusion":
            allowed = " \\| ".join(warm_start_fusions())
        rows.append(f"| `{s.path}` | {s.type.__name__} | `{s.default!r}` | {allowed} | {s.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


__all__ = ["RunConfig", "KeySpec", "SCHEMA", "TOP_LEVEL", "TOP_LEVEL_KEYS", "canonical", "parse_once", "ConfigError", "ConfigNote", "config_notes", "robust_min_replies", "parse_run_config", "fusion_options_dict", "check_files",
           "read_fusion_set",
           "check_model", "check_partitions", "check_device", "check_output_dir", "output_root", "run_name_problem", "data_options", "preflight", "auto_round_aggregation", "AUTO_SERVER_MOMENTUM", "strategy_names", "clients_per_round", "fusion_set_problem", "dataset_info",
           "describe", "load_initial_model", "warm_start_fusions", "MODES", "DATASETS", "HF_PREFIX", "MODELS", "MODEL_FAMILIES", "PARTITIONINGS", "OPTIMIZERS",
           "IMPORTANCE", "FUSION_SET_SOURCES", "FALLBACKS", "NON_FUSION_STRATEGIES"]

if __name__ == "__main__":
    print(describe())
    sys.exit(0)
