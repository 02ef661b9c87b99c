"""The registered methods ``fs-merge`` (global) and ``fs-merge-seq`` (sequential)."""

from __future__ import annotations

import math
import time
import warnings

import torch
from torch import nn

from fedfuse.fusion.fs_merge.data import prepare_data
from fedfuse.fusion.fs_merge.heads import fold_heads, heads_of
from fedfuse.fusion.fs_merge.options import FSMergeOptions, resolve_defaults
from fedfuse.fusion.fs_merge.structure import structure_for
from fedfuse.fusion.fs_merge.supernet import SuperNet
from fedfuse.fusion.fs_merge.training import epochs_to_steps, reconstruction_loss, train_supernet
from fedfuse.fusion.registry import (FusionOptionError, IncompatibleModelsError, MissingInputError,
                                     NumericalFusionError, register)


def _check_same_shapes(models: list[nn.Module]) -> None:
    ref = {k: tuple(v.shape) for k, v in models[0].state_dict().items()}
    for i, m in enumerate(models[1:], 1):
        sd = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        if sd != ref:
            diff = sorted(set(ref.items()) ^ set(sd.items()))[:3]
            raise IncompatibleModelsError(f"fs-merge: model {i} does not have model 0's architecture/widths "
                                          f"(e.g. {diff}); FS-Merge merges same-size models")


def _check_inputs(models: list[nn.Module], x) -> None:
    if len(models) < 2:
        raise IncompatibleModelsError(f"fs-merge: needs at least 2 models, got {len(models)}")
    if x is None:
        raise MissingInputError("fs-merge: needs fusion_inputs (an unlabeled [B, *input_shape] tensor)")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise MissingInputError("fs-merge: fusion_inputs must be a floating-point tensor [B, *input_shape]")
    if len(x) < 2:
        raise MissingInputError(f"fs-merge: fusion_inputs needs at least 2 samples, got {len(x)}")
    if not torch.isfinite(x).all():
        raise MissingInputError("fs-merge: fusion_inputs contains NaN or inf")
    _check_same_shapes(models)
    m0 = models[0]
    was_training = m0.training
    try:
        with torch.no_grad():
            m0.eval()(x[:2].to(next(m0.parameters()).device, next(m0.parameters()).dtype))
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # torch reports shape errors so
        raise IncompatibleModelsError(f"fs-merge: model 0 cannot run on fusion_inputs of shape {tuple(x.shape)}: "
                                      f"{exc}") from exc
    finally:
        m0.train(was_training)


def _dtype(models: list[nn.Module]) -> torch.dtype:
    """The models' floating dtype (the SuperNet trains in float32; the result is given back in the models' dtype)."""
    return next((p.dtype for p in models[0].parameters() if p.is_floating_point()), torch.float32)


def _warn_collapsed(what: str, collapsed: list[int], kept_step: int) -> None:
    """A loud warning when training reached collapsed states (constant merged features) that were passed over."""
    if collapsed:
        warnings.warn(f"{what}: the merged features collapsed to a constant at checkpoint steps {collapsed} (the "
                      f"reconstruction objective's trivial minimum); those states were not kept, the result is the "
                      f"state of step {kept_step} (0 = the start); try a lower lr", RuntimeWarning, stacklevel=3)


def _check_finite(model: nn.Module, what: str) -> None:
    bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NumericalFusionError(f"{what}: the folded model has non-finite weights ({bad[:3]}); training diverged "
                                   "(try a lower lr)")


def _fold(net: SuperNet, models: list[nn.Module], weights: list[float], heads: str) -> nn.Module:
    """The folded model: ``net``'s body plus the heads folded with ``U_final`` and the offsets: head k sees model
    k's feature estimate ``f_k ≈ r_k / s_k + μ_k = f U^(k) / s_k + (c_k / s_k + μ_k)``."""
    body = net.fold_body().cpu()
    s = net.target_scales.detach().cpu()
    centre = net.offset.detach().cpu() / s[:, None] + net.target_means.detach().cpu()
    return fold_heads(body, heads_of(models), net.final.dense().detach().cpu(), s.tolist(), weights, heads, centre)


PAPER_FS_MERGE = ('FS-Merge (Kinderman et al., "Foldable SuperNets: Scalable Merging of Transformers with Different '
                  'Initializations and Tasks", arXiv 2410.01483).')
@register("fs-merge", paper=PAPER_FS_MERGE, options=FSMergeOptions, needs_data=True, min_models=2)
def fuse_fs_merge(models, *, fusion_inputs, scores, weights, device, seed, options: FSMergeOptions,
                  info: dict) -> nn.Module:
    """Global FS-Merge of all ``models`` at once; returns one model of model 0's size (``FSMergeOptions``).

    Fixed point (copies of a model fuse back to it): with ``keep_best`` (default) the result is the state with the lowest reconstruction
    objective among the training start, the exact start (body as initialised — model 0 for ``init="first"`` —
    with an exact reconstruction of every model that agrees with it: objective 0 for copies) and the training
    checkpoints. So ``fuse("fs-merge", [a, a, ...], weights=w)`` is ``a`` (the shared head is ``Σ_k w_k W_k =
    W``), and a near-agreement gives a model no worse on the objective than model 0 with exact reconstructions,
    hence near the average. Disagreeing models: training runs as without ``keep_best`` and its state is kept
    when better (the usual case), so the accuracy is unchanged.

    ``info`` gets ``loss_before`` / ``loss_after`` (reconstruction MSE at the training start / of the result),
    ``epoch_losses`` (training history), ``objective_start`` / ``objective_exact`` / ``objective_best`` (the
    weighted training objective on the whole pool at the training start, at the exact start and of the state
    kept), ``best_step`` (steps to the kept state; 0 = a start) and ``kept_exact``, ``steps``
    (planned) and ``steps_run`` (fewer once the objective is ~0: nothing left to improve),
    ``pool`` (training inputs), ``seconds`` and ``trainable`` (parameter count).
    """
    _check_inputs(models, fusion_inputs)
    cfg = resolve_defaults(options, structure_for(models).kind)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    data = prepare_data(models, fusion_inputs, cfg, device, gen)
    net = SuperNet(models, rank=cfg.rank, init=cfg.init, device=device, seed=seed, target_scales=data.scales,
                   target_means=data.means)
    steps = epochs_to_steps(cfg, len(data.pool))
    before = reconstruction_loss(net, data.pool, data.targets, cfg.route)
    run = train_supernet(net, data.pool, data.targets, data.mask, torch.tensor(weights, dtype=torch.float32),
                         cfg, steps, gen, device)
    after = reconstruction_loss(net, data.pool, data.targets, cfg.route)
    _warn_collapsed("fs-merge", run.collapsed, run.best_step)
    fused = _fold(net, models, weights, cfg.heads).to(_dtype(models))
    info.update({"loss_before": before, "loss_after": after, "epoch_losses": run.epoch_losses, "steps": steps,
                 "objective_start": run.start_loss, "objective_exact": run.exact_loss,
                 "objective_best": run.best_loss, "best_step": run.best_step, "kept_exact": run.kept_exact,
                 "steps_run": run.steps, "collapsed_checkpoints": run.collapsed,
                 "pool": len(data.pool), "seconds": time.perf_counter() - t0,
                 "trainable": sum(p.numel() for p in net.parameters() if p.requires_grad)})
    if run.diverged or not math.isfinite(after):  # the kept state may be finite: a divergence is still reported
        raise NumericalFusionError(f"fs-merge: training diverged (non-finite reconstruction loss; try a lower lr "
                                   f"than {cfg.lr})")
    _check_finite(fused, "fs-merge")
    return fused


PAPER_FS_MERGE_SEQ = ("Sequential FS-Merge: models 0 and 1, then the result with model 2, ...")
@register("fs-merge-seq", paper=PAPER_FS_MERGE_SEQ, options=FSMergeOptions, needs_data=True, min_models=2)
def fuse_fs_merge_seq(models, *, fusion_inputs, scores, weights, device, seed, options: FSMergeOptions,
                      info: dict) -> nn.Module:
    """FS-Merge seq.: merge models 0 and 1, then the result with model 2, ...

    Stage t is a 2-model SuperNet ``(merged_{t-1}, model_{t+1})`` with "first" init (it starts exactly at the
    previous stage's model) and a ``U_final`` of t+2 blocks whose first t+1 start at the previous stage's,
    trained against all original models seen so far. Same options as ``fs-merge``; ``stage_steps`` (default
    ``steps // 4``, the paper's 50-of-200 ratio) for intermediate stages, ``steps`` for the last. Each stage
    keeps its best state incl. its exact start (``keep_best``: the previous merge, an exact reconstruction of the
    new model where it agrees), so agreeing models stay exactly model 0 through every stage (fixed point).
    ``info`` gets ``stage_losses`` (per stage, the per-epoch losses), ``stage_best_steps`` (per stage, the step of
    the state kept; 0 = a start), ``stage_kept_exact`` (per stage, whether the exact start was kept), ``seconds``
    and ``pool``.

    Default schedule (600 + 150 per intermediate stage, lr 1e-3 for MLPs) works out of the box with 3-4 clients
    (a too large MLP lr, not the stage length, makes ReLUs die and the merge collapse). It was the best measured
    setting on held-out fusion data: longer intermediate stages were not better and cost more time (figures:
    ``docs/measurements-fusion.md``).
    """
    if options.init != "first":
        raise FusionOptionError("fs-merge-seq: stages are initialised from the previous merge; only init='first' "
                                f"applies, got init={options.init!r}")
    _check_inputs(models, fusion_inputs)
    cfg = resolve_defaults(options, structure_for(models).kind)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    data = prepare_data(models, fusion_inputs, cfg, device, gen)
    n = len(models)
    merged, final, offset, hist, best_steps, kept_exact = models[0], None, None, [], [], []
    tw_all = torch.tensor(weights, dtype=torch.float32)
    for stage in range(1, n):
        last = stage == n - 1
        t = stage + 1                                           # targets: models 0..stage
        if final is None:
            base = None
        else:                                                   # previous U_final blocks + identity for the new one
            d = final.shape[0]
            base = torch.cat([final, torch.eye(d)], dim=1)
            offset = torch.cat([offset, torch.zeros(1, d)])     # ... and previous offsets + 0 for the new one
        net = SuperNet([merged, models[stage]], rank=cfg.rank, init="first", num_targets=t,
                       final_base=None if base is None else base.to(device), device=device, seed=seed + stage,
                       target_scales=data.scales[:t], target_means=data.means[:t], offset_init=offset)
        pool_steps = epochs_to_steps(cfg, len(data.pool))
        steps = pool_steps if last else (cfg.stage_steps or max(1, pool_steps // 4))
        mask = None if data.mask is None else data.mask[:, :t]
        if mask is not None:   # samples of clients not merged yet carry no target at this stage
            keep = mask.sum(1) > 0
            pool, targets, mask = data.pool[keep], data.targets[keep.to(data.targets.device)][:, :t], mask[keep]
        else:
            pool, targets = data.pool, data.targets[:, :t]
        run = train_supernet(net, pool, targets, mask, tw_all[:t], cfg, steps, gen, device)
        _warn_collapsed(f"fs-merge-seq stage {stage}", run.collapsed, run.best_step)
        kept_exact.append(run.kept_exact)
        if run.diverged:
            raise NumericalFusionError(f"fs-merge-seq: stage {stage} training diverged (non-finite reconstruction "
                                       f"loss; try a lower lr than {cfg.lr})")
        hist.append(run.epoch_losses)
        best_steps.append(run.best_step)
        merged = net.fold_body().cpu()
        final = net.final.dense().detach().cpu()
        offset = net.offset.detach().cpu()
    fused = _fold(net, models, weights, cfg.heads).to(_dtype(models))
    info.update({"stage_losses": hist, "stage_best_steps": best_steps, "stage_kept_exact": kept_exact,
                 "seconds": time.perf_counter() - t0,
                 "pool": len(data.pool)})
    _check_finite(fused, "fs-merge-seq")
    return fused
