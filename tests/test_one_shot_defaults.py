"""One-shot mode's defaults (issue 13's one-shot tier cells): no divergence guard, distillation after fusion."""

from fedfuse.config import parse_run_config


def test_one_shot_runs_without_the_divergence_guard():
    """One-shot clients start from independent initialisations: their weighted average is no fallback model."""
    from fedfuse.flower.server_app import setup

    base = {"dataset": "synthetic", "num-clients": 3, "strategy": "kf-linear", "fusion-set-size": 40}
    _, _, multi = setup(parse_run_config(base))
    _, _, shot = setup(parse_run_config({**base, "mode": "one-shot", "num-server-rounds": 1,
                                         "client-tiers": "1,0.5"}))
    assert multi.guard and not shot.guard


def test_one_shot_fusion_distills_by_default_with_a_public_fusion_set():
    from fedfuse.flower.server_app import resolved_refine

    shot = {"mode": "one-shot", "num-server-rounds": 1, "strategy": "kf-linear"}
    assert resolved_refine(parse_run_config(shot)) == "distill"
    assert resolved_refine(parse_run_config({**shot, "fusion-set-source": "client0"})) is None   # strategy default
    assert resolved_refine(parse_run_config({**shot, "strategy": "kd"})) is None                # the KD baseline
    assert resolved_refine(parse_run_config({**shot, "refine": "none"})) == "none"
    assert resolved_refine(parse_run_config({"strategy": "kf-linear"})) is None                 # multi-round
