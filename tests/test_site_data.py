"""A site's own data (node config ``data-path``, ``dpfl export-partition``) and the public
bound ``min-client-records`` every client is calibrated and charged from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfl.cli import main
from dpfl.client.cache import node_problem
from dpfl.errors import ConfigError
from dpfl.privacy import PrivacyLedger
from dpfl.problem import build_problem, cached_problem
from dpfl.runconfig import RunConfig

RUN = {"algorithm": "dpsgd-gc", "num-partitions": 3, "seed": 2, "batch-size": 16,
       "noise-multiplier": 1.2}


def _items(values: dict) -> tuple:
    return tuple(sorted(RunConfig(values).as_dict().items()))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Client 2's records of RUN's split, exported as a site file."""
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    node_problem.cache_clear()
    path = tmp_path / "site.npz"
    assert main(["export-partition", str(path), "-c", "num-partitions=3 seed=2",
                 "--partition-id", "2"]) == 0
    yield str(path)
    node_problem.cache_clear()


def test_a_site_trains_what_the_split_would_have(site):
    config = {**RUN, "min-client-records": 100}
    node = node_problem(_items(config), (2,), site)
    run = build_problem(RunConfig(config))
    assert torch.equal(node.cohort([2]).x, run.cohort([2]).x)
    assert torch.equal(node.cohort([2]).y, run.cohort([2]).y)
    assert torch.equal(node.x0, run.x0)
    # both sides calibrate from the bound, not from the client's 479 records
    assert node.releases(2) == run.releases(2)
    assert [r.sample_rate for r in run.releases(2)] == [16 / 100]


def test_the_bound_charges_at_least_the_real_sample_rate(site):
    """ε is nondecreasing in the sample rate: charging b/n_min bounds the real b/n."""
    real = build_problem(RunConfig(RUN)).releases(2)
    bound = build_problem(RunConfig({**RUN, "min-client-records": 100})).releases(2)
    assert real[0].sample_rate == 16 / 479 < bound[0].sample_rate
    for accountant in ("rdp", "prv"):
        epsilons = []
        for releases in (real, bound):
            ledger = PrivacyLedger(accountant, "add-remove")
            for _ in range(50):
                ledger.record(releases[0])
            epsilons.append(ledger.epsilon(1e-5))
        assert epsilons[0] < epsilons[1], accountant


@pytest.mark.parametrize(("change", "key", "words"), [
    ({}, "min-client-records", "needs the run's public lower bound"),
    ({"min-client-records": 480}, "min-client-records", "holds fewer records than the bound"),
    ({"min-client-records": 10}, "batch-size", "exceeds the records"),
    ({"min-client-records": 100, "dataset": "mnist"}, "data-path", "holds 'digits' records"),
])
def test_a_site_that_does_not_fit_refuses(site, change, key, words):
    with pytest.raises(ConfigError) as refused:
        node_problem(_items({**RUN, **change}), (2,), site)
    assert refused.value.key == key and words in str(refused.value)
    assert "479" not in str(refused.value)  # the site's count never leaves it


def test_a_site_hosts_one_client_and_a_readable_file(site, tmp_path):
    config = _items({**RUN, "min-client-records": 100})
    with pytest.raises(ConfigError, match="'partition-ids'.*hosts one client"):
        node_problem(config, (1, 2), site)
    broken = tmp_path / "broken.npz"
    np.savez(broken, x=np.zeros((3, 4), np.float32))
    for path in (str(broken), str(tmp_path / "missing.npz")):
        with pytest.raises(ConfigError, match="'data-path'.*cannot read"):
            node_problem(config, (2,), path)


def test_the_bound_is_checked_against_the_split():
    cached_problem.cache_clear()
    with pytest.raises(ConfigError, match="'min-client-records': 480 exceeds a client's 479"):
        build_problem(RunConfig({**RUN, "min-client-records": 480}))
    with pytest.raises(ConfigError, match=r"'batch-size': 16 exceeds min-client-records \(10\)"):
        build_problem(RunConfig({**RUN, "min-client-records": 10}))


def test_export_partition_bad_input(site, capsys):
    assert main(["export-partition", site, "--partition-id", "0"]) == 2
    assert main(["export-partition", site + ".new", "--partition-id", "3",
                 "-c", "num-partitions=3"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [f"dpfl: error: {site} exists: a site's data file is never overwritten",
                      "dpfl: error: --partition-id: 3 (allowed: 0..2)"]
