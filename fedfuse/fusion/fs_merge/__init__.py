"""FS-Merge: Foldable SuperNets (Kinderman, Hubara, Maron, Soudry, "Foldable SuperNets: Scalable Merging of Transformers
with Different Initializations and Tasks", arXiv 2410.19251).

Registered methods (both ``needs_data=True``)::

    fuse("fs-merge", models, fusion_inputs=X, device="auto", **options)       # global FS-Merge, n models at once
    fuse("fs-merge-seq", models, fusion_inputs=X, device="auto", **options)   # sequential: ((m0+m1)+m2)+...

What is implemented:

- merge (M, ``[n·d, d]``) and unmerge (U, ``[d, n·d]``) matrices parameterised as stacked diagonals plus a
  low-rank term ``A @ B`` (``rank``; ``rank="full"`` gives a dense residual, as in the paper's MLP runs); the
  hidden-width (transformer MLP) matrices use rank ``rank·h/d``.
- initialisations ``"first"`` (SuperNet == model 0 exactly), ``"average"`` (folds to the weight average),
  ``"random"``; low-rank factors start at ``A = 0`` so the first/average inits are exact. Not in the paper
  (so that fusing copies of one model returns it): ``keep_best`` returns the state with the lowest reconstruction objective among the training start,
  the *exact start* (``SuperNet.exact_start_``: the initial body with ``U_final^(k) = s_k I`` and offset
  ``−s_k μ_k``, an exact reconstruction of every model that agrees with the body) and ~10 training checkpoints:
  fusing copies of one model returns it, a near-agreement gives a near-average, and the result is never worse
  on the objective than either start.
- global FS-Merge for MLPs (any ``nn.Sequential`` of Linear layers and element-wise activations) and
  the transformer SuperNet for timm ``VisionTransformer`` s: patch embedding/CLS/position merged by
  ``M_in`` (no U, B.1.1), attention block with one shared U, three merges M^Q/M^K/M^V, output unmerge U^O and
  merge M^O with the residual at merged width (B.1.2), MLP block U¹/M¹/U²/M² with the activation at merged
  hidden width (B.1.3), learned merged LayerNorms (rule iii), final reconstruction ``U_final`` (B.2).
- any other model fedfuse reads a permutation spec from (a user's ``nn.Module``, torchvision / timm CNNs, fedfuse's
  CNNs and ResNets): the same rules on the spec's groups (``structure_graph``): one M per group on the layers that
  produce its units, one U per group on those that consume them, every other per-unit parameter (norms,
  depthwise convolutions, layer scale) learned at merged width.
- global feature-reconstruction MSE on each model's final pre-head features (no labels), per-model
  target scaling, a fixed set of augmented copies of the small fusion set, AdamW with a one-cycle
  (linear warm-up, cosine decay) schedule; the per-task loss when ``task_ids`` are given, else the
  all-models loss.
- folding ``W* = U·blockdiag(W¹..Wⁿ)·M``, ``b* = Σ_k b^k M_k``; the learned LNs are copied. Training
  uses the exact single-width reparameterisation (``route="folded"``, default: the folded model is rebuilt
  every step, activation memory of one model) or the paper's wide SuperNet (``route="wide"``); both are the
  same function (tested).
- heads: ``heads="shared"`` (same-task FL, Option A) folds ``W = Σ_k w_k W_head^k U_final^(k)`` into one
  head of the original size; ``heads="multi"`` (the paper's different-task setting) returns one head of
  ``n·C`` outputs whose k-th block is head k folded with ``U_final^(k)`` (argmax over it = joint accuracy).
- FS-Merge seq.: stage t merges the previous folded model with the next client (2-model SuperNet,
  initialised to the previous stage's solution, ``U_final`` grows one block per stage) against the targets of
  all clients seen so far.

Collapse defence (a failure mode of one-shot merging with a skewed fusion set; not in the paper): a fusion set drawn from one client's
classes gives no signal about what the other clients compute on *their* classes, so a SuperNet started at
model 0 stays model 0 there. The default defence is the all-clients reconstruction loss (every fusion input is
scored against every client's centred, per-client-scaled features) plus augmented copies and dense M/U for MLPs
(tested on a class-sharded split). ``synth`` (opt-in, default 0) additionally adds, per client k, inputs synthesised by inverting model
k: starting from augmented fusion samples, gradient steps raise model k's logit for a class drawn from
model k's own (tempered) mean prediction on the fusion set — so each client contributes inputs from the
classes *it* knows — while a proximity penalty keeps them near the data. These inputs get every client's
features as targets like any other input.

Modules: ``matrices`` (M/U matrices, folding one slot), ``structure`` (``structure_for(models)``: the per-family
SuperNet layout, ``structure_sequential`` for MLPs, ``structure_vit`` for ViTs and ``structure_graph`` for any other
model, picked by the adapter family),
``supernet`` (the SuperNet), ``heads`` (class heads), ``data`` (augmentation,
synthesised inputs, targets), ``training`` (the reconstruction training), ``options`` (``FSMergeOptions``), ``method`` (the registered
methods; diagnostics go to ``fuse_result(...).info``).

Paper defaults for ViT-B-size models (the paper's appendix E.2), for reference: ``rank=12`` (2 models), 24–32 (3–5 models),
16 for seq.; hidden rank 4r; AdamW lr 1e-4, weight decay 1e-3, batch 128, ~200 epochs over 16–100 originals
+ 800–1000 augmented copies per task; seq: 50 epochs per intermediate stage, 200 for the last. The defaults
below are for CPU-size models (width ≤ ~256, a few hundred fusion inputs) and were chosen on digits/MNIST-1D.
"""

from fedfuse.fusion.fs_merge.data import augment_inputs, prepare_data, synthesize_inputs, target_features
from fedfuse.fusion.fs_merge.heads import fold_heads, heads_of
from fedfuse.fusion.fs_merge.matrices import INITS, MergeMatrix, fold_linear, split_blocks, unmerge, wide_linear
from fedfuse.fusion.fs_merge.method import fuse_fs_merge, fuse_fs_merge_seq
from fedfuse.fusion.fs_merge.options import FSMergeOptions, resolve_defaults
from fedfuse.fusion.fs_merge.structure import (STRUCTURES, GraphMergeStructure, SequentialMergeStructure, ViTMergeStructure,
                                             structure_for)
from fedfuse.fusion.fs_merge.supernet import Features, SuperNet, merge_structure
from fedfuse.fusion.fs_merge.training import (TrainResult, epochs_to_steps, objective, reconstruction_loss,
                                              train_supernet)

__all__ = ["FSMergeOptions", "resolve_defaults", "fuse_fs_merge", "fuse_fs_merge_seq", "MergeMatrix", "INITS",
           "split_blocks", "fold_linear", "wide_linear", "unmerge", "SuperNet", "Features", "merge_structure",
           "structure_for", "STRUCTURES", "GraphMergeStructure", "SequentialMergeStructure", "ViTMergeStructure",
           "fold_heads", "heads_of", "augment_inputs", "synthesize_inputs", "target_features", "prepare_data",
           "train_supernet", "TrainResult", "objective", "reconstruction_loss", "epochs_to_steps"]
