"""Architecture adapters (fedfuse.models.adapters): one per family, the only place knowing its layout.

Per family: the fusion levels keep their names/widths (client importance scores are keyed by them), the
family can be rebuilt at another width/depth, the permutation spec is a true symmetry (a randomly permuted
copy computes the same function) and FS-Merge finds its SuperNet layout. Unsupported models fail clearly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.fusion import IncompatibleModelsError
from fedfuse.fusion.fs_merge import Features, SequentialMergeStructure, SuperNet, ViTMergeStructure, structure_for
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.models import (ADAPTERS, UnsupportedModelError, adapter_for, build_model, levels, model_family)

# (name, input_shape, options) → reference [(level name, width)] (the listing before the adapters existed)
REFERENCE_LEVELS = [
    ("mlp", (1, 8, 8), {}, [("1", 64), ("3", 64), ("5", 10)]),
    ("mlp", (20,), {"batchnorm": True}, [("2", 64), ("5", 64), ("7", 10)]),
    ("cnn", (1, 8, 8), {"batchnorm": True}, [("1", 16), ("5", 32), ("10", 10)]),
    ("cnn", (1, 40), {}, [("0", 16), ("3", 32), ("8", 10)]),
    ("resnet", (1, 8, 8), {}, [("stem", 16), ("blocks.0", 16), ("blocks.1", 32), ("fc", 10)]),
    ("resnet", (1, 40), {"blocks_per_stage": 2},
     [("stem", 16), ("blocks.0", 16), ("blocks.1", 16), ("blocks.2", 32), ("blocks.3", 32), ("fc", 10)]),
    ("vit", (1, 8, 8), {}, [("blocks.0", 32), ("blocks.1", 32), ("head", 10)]),
    ("vit", (1, 40), {"reg_tokens": 1}, [("blocks.0", 32), ("blocks.1", 32), ("head", 10)]),
]
FAMILY = {"mlp": "sequential", "cnn": "sequential", "resnet": "resnet", "vit": "vit"}


def _ids(cases):
    return [f"{c[0]}-{'x'.join(map(str, c[1]))}-{'-'.join(c[2]) or 'default'}" for c in cases]


def test_registry_lists_the_families():
    assert list(ADAPTERS) == ["sequential", "resnet", "vit", "torchvision-resnet", "graph"]   # the last: tests/test_torchvision_resnet.py
    for name, fam in FAMILY.items():
        m = build_model(name, 10, (1, 8, 8))
        assert model_family(m) == fam and adapter_for(m) is ADAPTERS[fam]


@pytest.mark.parametrize("name,shape,kw,expected", REFERENCE_LEVELS, ids=_ids(REFERENCE_LEVELS))
def test_levels_unchanged(name, shape, kw, expected):
    m = build_model(name, 10, shape, **kw)
    assert [(lv.name, lv.width) for lv in levels(m)] == expected
    assert [(lv.name, lv.width) for lv in adapter_for(m).levels(m)] == expected


@pytest.mark.parametrize("name,shape,kw,width,depth,expected", [
    ("mlp", (1, 8, 8), {}, 24, 3, [24, 24, 24, 10]),
    ("mlp", (20,), {"batchnorm": True}, 8, 1, [8, 10]),
    ("cnn", (1, 8, 8), {"batchnorm": True}, 8, 3, [8, 16, 32, 10]),
    ("cnn", (1, 40), {}, 4, 1, [4, 10]),
    ("resnet", (1, 8, 8), {}, 8, 3, [8, 8, 16, 32, 10]),
    ("resnet", (1, 40), {"blocks_per_stage": 2, "norm": "group"}, 8, 1, [8, 8, 8, 10]),
    ("vit", (1, 8, 8), {}, 48, 3, [48, 48, 48, 10]),
    ("vit", (1, 40), {"reg_tokens": 1}, 16, 1, [16, 10]),
])
def test_resize_builds_working_model_of_new_width_and_depth(name, shape, kw, width, depth, expected):
    m = build_model(name, 10, shape, **kw)
    adapter = adapter_for(m)
    cfg = adapter.config(m)
    assert (cfg.family, cfg.name, cfg.num_classes) == (FAMILY[name], name, 10)
    small = adapter.resize(m, width=width, depth=depth, seed=1, input_shape=shape)
    assert type(small) is type(m) and model_family(small) == FAMILY[name]
    assert [lv.width for lv in levels(small)] == expected
    new = adapter.config(small)
    assert (new.width, new.depth) == (width, depth)
    if name != "cnn":                                  # a CNN's layers fix only a smallest input size
        assert new.input_shape == cfg.input_shape
    assert {k: v for k, v in new.options.items() if k != "num_heads"} == \
        {k: v for k, v in cfg.options.items() if k != "num_heads"}
    with torch.no_grad():
        assert small.eval()(torch.randn(3, *shape)).shape == (3, 10)
    # the config of an unchanged model rebuilds the same architecture
    same = adapter.build(cfg, seed=2)
    assert {k: v.shape for k, v in same.state_dict().items()} == {k: v.shape for k, v in m.state_dict().items()}


def test_vit_resize_scales_heads_and_mlp_with_width_keeping_head_dim():
    v = build_model("vit", 10, (1, 8, 8), width=32, num_heads=4, mlp_ratio=2.0)
    w = adapter_for(v).resize(v, width=64)
    assert w.blocks[0].attn.num_heads == 8 and w.blocks[0].attn.head_dim == 8
    assert w.blocks[0].mlp.fc1.out_features == 128
    with pytest.raises(ValueError, match="head dim"):
        adapter_for(v).resize(v, width=36)


def test_cnn_config_input_size_keeps_pooling_layout():
    m = build_model("cnn", 10, (3, 32, 32), depth=2)
    cfg = adapter_for(m).config(m)
    assert cfg.input_shape[0] == 3
    rebuilt = adapter_for(m).build(cfg)
    assert [type(x) for x in rebuilt] == [type(x) for x in m]
    # deeper: whether the new stage pools depends on the input size, which the layers do not fix
    with pytest.raises(UnsupportedModelError, match="input_shape"):
        adapter_for(m).resize(m, depth=3)
    deep = adapter_for(m).resize(m, depth=3, input_shape=(3, 32, 32))
    ref = build_model("cnn", 10, (3, 32, 32), depth=3)
    assert [type(x) for x in deep] == [type(x) for x in ref]
    assert {k: v.shape for k, v in deep.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("name,shape,kw", [(c[0], c[1], c[2]) for c in REFERENCE_LEVELS], ids=_ids(REFERENCE_LEVELS))
def test_perm_spec_round_trip_preserves_outputs(name, shape, kw):
    m = build_model(name, 10, shape, seed=3, **kw).eval()
    spec = adapter_for(m).perm_spec(m)
    assert spec.family == FAMILY[name] and spec.groups
    p = permute_model(m, random_perms(build_spec(m), seed=5)).eval()
    moved = sum(not torch.equal(a, b) for a, b in zip(m.state_dict().values(), p.state_dict().values()))
    assert moved > 0                                   # the weights really moved ...
    x = torch.randn(6, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(m(x), p(x), atol=1e-5)   # ... and the function did not


@pytest.mark.parametrize("name,shape,structure", [("mlp", (1, 8, 8), SequentialMergeStructure),
                                                  ("vit", (1, 8, 8), ViTMergeStructure),
                                                  ("vit", (1, 40), ViTMergeStructure)])
def test_fs_merge_structure_found(name, shape, structure):
    models = [build_model(name, 10, shape, seed=s) for s in range(2)]
    st = structure_for(models)
    assert isinstance(st, structure)
    assert st.d == (32 if name == "vit" else 64)       # merged feature width = the model's pre-head width
    net = SuperNet(models, rank=2, init="first")
    x = torch.randn(4, *shape)
    with torch.no_grad():                              # "first" init folds to model 0 exactly
        assert torch.allclose(net.features(x), Features(models[0])(x), atol=1e-5)


def test_fs_merge_structure_of_resnet_and_cnn_is_read_off_their_spec():
    """Families without a hand-built SuperNet (fedfuse's ResNet, CNN chains) take the layout read off their
    permutation spec; MLPs keep the paper's MLP layout."""
    for name in ("resnet", "cnn"):
        m = build_model(name, 10, (1, 8, 8))
        assert type(structure_for([m, m])).__name__ == "GraphMergeStructure"
    mlp = build_model("mlp", 10, (1, 8, 8))
    assert type(structure_for([mlp, mlp])).__name__ == "SequentialMergeStructure"


def test_outside_timm_vit_is_handled():
    from timm.models.vision_transformer import VisionTransformer

    v = VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=5, embed_dim=16, depth=1, num_heads=2,
                          global_pool="token")
    adapter = adapter_for(v)
    assert adapter.family == "vit" and [(lv.name, lv.width) for lv in levels(v)] == [("blocks.0", 16), ("head", 5)]
    assert [lv.width for lv in levels(adapter.resize(v, width=32, depth=2))] == [32, 32, 5]
    avg = VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=5, embed_dim=16, depth=1, num_heads=2,
                            global_pool="avg", class_token=False)
    assert [lv.width for lv in levels(avg)] == [16, 5]
    with pytest.raises(UnsupportedModelError, match="not laid out like fedfuse's vit"):
        adapter.config(avg)


def test_unsupported_models_raise_clear_errors():
    assert adapter_for(nn.LSTM(3, 3)).family == "graph"   # any other module goes to the generic reader ...
    with pytest.raises(ValueError, match="graph reader: GRU has no Linear/Conv layer"):   # ... which says what it lacks
        levels(nn.GRU(3, 3))
    with pytest.raises(ValueError, match="graph reader: GRU has no Linear/Conv layer"):
        build_spec(nn.GRU(3, 3))
    odd = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    assert [lv.width for lv in levels(odd)] == [8, 3]                  # levels work for any such stack ...
    with pytest.raises(UnsupportedModelError, match="not laid out like fedfuse's mlp or cnn"):
        adapter_for(odd).config(odd)                                   # ... a rebuild needs fedfuse's layout
    with pytest.raises(ValueError, match="width must be a positive int"):
        adapter_for(build_model("mlp")).resize(build_model("mlp"), width=0)
