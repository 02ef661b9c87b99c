"""``simulations.bench.auto_candidates``: the candidate sets it compares and its table of each set's gap to the best
fixed method."""

from __future__ import annotations

from simulations.bench.auto_candidates import OLD, parse_sets, summarise
from fedfuse.fusion.auto import DEFAULT_CANDIDATES


def test_sets_name_the_old_and_current_defaults_and_the_refit():
    sets = parse_sets("old|no-refit;default;kf-linear|kd")
    assert sets["old|no-refit"] == (OLD, False)
    assert sets["default"] == (DEFAULT_CANDIDATES, True)
    assert sets["kf-linear|kd"] == (("kf-linear", "kd"), True)


def test_the_table_gives_each_set_its_gap_to_the_best_fixed_method_on_the_means():
    def row(seed, kd, kf, auto, choice):
        return {"data": "fmnist", "clients": 5, "alpha": 0.3, "seed": seed,
                "fixed": {"average": 0.1, "kf-linear": kf, "kf-gradient": 0.5, "ot": 0.4, "feddf": 0.6, "kd": kd},
                "auto": {"default": auto}, "choice": {"default": choice}}
    text = summarise([row(0, 0.80, 0.70, 0.79, "kd"), row(1, 0.78, 0.72, 0.77, "kd")])
    assert "| fmnist | lenet | 5 | 0.3 | kd 79.0 | 78.0 ± 1.4 (-1.0; kd/kd) |" in text
