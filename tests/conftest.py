import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)


# ------------------------------------------------------------------ real `flwr run`s shared by several tests
# (tests/support/shared_runs.py: each costs a SuperLink, a Ray cluster and a process per node, most of its time)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def e2e_flwr_run(tmp_path_factory):
    """The default strategy ``auto`` end to end through a real ``flwr run`` (``shared_runs.E2E``, head round on)."""
    from tests.support.shared_runs import E2E, real_run

    return real_run(E2E, tmp_path_factory.mktemp("e2e-flwr"), "e2e", E2E["num-clients"])


@pytest.fixture(scope="session")
def tiers_flwr_run(tmp_path_factory):
    """kf-linear over width tiers 1 / 0.5 / 0.25 through a real ``flwr run`` (``shared_runs.TIERS``)."""
    from tests.support.shared_runs import TIERS, real_run

    return real_run({**TIERS, "strategy": "kf-linear"}, tmp_path_factory.mktemp("tiers-flwr"), "tiers",
                    TIERS["num-clients"])


@pytest.fixture(scope="session")
def example_flwr_run(tmp_path_factory):
    """``examples/own-flower-app`` by its README's plain ``flwr run`` (2 SuperNodes, 2 rounds); the local SuperLink it
    leaves is stopped at the end of the session if no test stopped it (``tests/test_stop_superlink.py`` does)."""
    from tests.support.shared_runs import plain_example_run, stop_local_superlink

    run = plain_example_run(tmp_path_factory.mktemp("example-flwr"))
    try:
        yield run
    finally:
        stop_local_superlink(run.home)
