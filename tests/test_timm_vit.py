"""timm's ``vit_tiny_patch16_224`` as users have it (issue 24: "timm's vit_tiny_patch16_224 fuses as it comes"): every
fusion method fuses two of them into a model mapping inputs to logits, or refuses with an error that says why. The
models are built at 32 px (4 patches) so that the smoke test stays seconds, not minutes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

timm = pytest.importorskip("timm")

from fedfuse.fusion import METHOD_SPECS, METHODS, IncompatibleModelsError, fuse  # noqa: E402


def _vit(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_fuses_two_timm_vit_tiny_or_says_why(method):
    models = [_vit(s) for s in (1, 2)]
    before = [copy.deepcopy(m.state_dict()) for m in models]
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    spec = METHOD_SPECS[method]
    fields = {f.name for f in dataclasses.fields(spec.options)}
    fast = {k: 1 for k in ("epochs", "head_epochs") if k in fields}
    if method == "fedfisher":   # the server's Adam steps (2,000 by default): the interface, not the optimum
        fast["steps"] = 10
    try:
        fused = fuse(method, models, fusion_inputs=x, **fast)
    except IncompatibleModelsError as exc:   # e.g. the closed-form fits need affine levels
        assert "vit" in str(exc) or "block levels" in str(exc), exc
        return
    with torch.no_grad():
        assert fused(x).shape == (16, 5)
    for m, b in zip(models, before):   # fuse never changes its inputs
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())
