"""Nothing leaves a client un-noised: the message schema is the privacy boundary.

For every algorithm dpfl registers: every record a client sends over Flower is an upload its
algorithm declares, covered by a release with noise; and the replies of two neighbouring
datasets (one record of a client replaced) under the same seed agree in everything but the
noised arrays, which differ by at most their release's sensitivity. Before the boundary existed
clients also sent their exact training loss, gradient norms and clipping counts, which differ
between neighbours however large the noise: the second test fails on such a reply.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from dpfl.algorithms import ALGORITHMS, ServerContext
from dpfl.client.app import reply
from dpfl.privacy import RELATIONS, Randomness
from dpfl.problem import build_problem
from dpfl.runconfig import RunConfig
from dpfl.strategies.algorithm import to_record
from tests.inprocess_grid import InProcessGrid, run_flower_code_path

OWN = sorted(name for name in ALGORITHMS.names()
             if ALGORITHMS.get(name).__module__.startswith("dpfl.algorithms")
             and not ALGORITHMS.get(name).noise_free)
NOISE_FREE = sorted(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).noise_free)
VARIANTS = {"clip-sgd": [{}, {"clipping": "per-sample"}],
            "dp-fedavg-quantile": [{"clipped-count-stddev": 5.0}]}
CASES = [(name, extra) for name in OWN for extra in VARIANTS.get(name, [{}])]
IDS = [name + "".join(f"-{v}" for v in extra.values()) for name, extra in CASES]
# central DP (a trusted server noises clipped updates): protects a whole client, not a record
LOCAL = [(name, extra) for name, extra in CASES
         if not ALGORITHMS.get(name).central_releases()]
LOCAL_IDS = [i for i, case in zip(IDS, CASES, strict=True) if case in LOCAL]
# digits' 1437 training images in 3 equal partitions, batch = a client's whole data: the
# replaced record is in every batch (Poisson sampling at rate 1 too)
BASE = {"num-partitions": 3, "batch-size": 479, "num-server-rounds": 2, "learning-rate": 0.1}
# a public subspace needs public records: 3 held out leave 478 per client
PUBLIC = {"dataset-options": "num_public=3", "batch-size": 478}


def base(name: str) -> dict:
    """BASE, with public records for an algorithm that projects onto them."""
    public = getattr(ALGORITHMS.get(name).Hyperparameters, "projection", None) == "public"
    return {**BASE, **(PUBLIC if public else {})}


class RecordingGrid(InProcessGrid):
    """Keeps every reply a node sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.replies += replies
        return replies


@pytest.mark.parametrize("name, extra", CASES, ids=IDS)
def test_every_record_a_client_sends_is_an_upload_covered_by_a_noised_release(tmp_path, name,
                                                                             extra):
    values = {**base(name), **extra, "algorithm": name, "noise-multiplier": 1.0,
              "results-dir": str(tmp_path), "run-name": "run"}
    grid, problem = run_flower_code_path(values, [{"partition-id": i} for i in range(3)],
                                         grid_class=RecordingGrid)
    algorithm = problem.algorithm
    uploads = {key: upload for e in algorithm.exchanges for key, upload in e.uploads.items()}
    sent = 0
    for message in grid.replies:
        content = message.content
        if message.metadata.message_type == f"{MessageType.QUERY}.clients":
            assert list(content) == ["hosted"]  # which partitions the node hosts: public
            assert set(content["hosted"]) == {"clients"}
            continue
        for record_name, record in content.items():
            if record_name.startswith("ledger."):  # the client's own ledger: public releases
                assert isinstance(record, ConfigRecord) and list(record) == ["json"]
                continue
            assert record_name.startswith("client."), record_name
            assert isinstance(record, ArrayRecord), record_name
            client = int(record_name.removeprefix("client."))
            releases = {r.name: r for r in problem.releases(client)}
            central = {r.name: r for r in problem.server_releases()}
            for key in record:
                if uploads[key].central:  # noised by the server, and the run says so
                    release = central[uploads[key].release]
                    assert release.noise_multiplier > 0 and release.side == "server"
                    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
                    assert summary["privacy"]["guarantee_against_server"] is False
                else:
                    release = releases[uploads[key].release]
                    assert release.noise_multiplier > 0 and release.side == "client"
                sent += 1
    assert sent == 3 * sum(len(e.uploads) for r in (1, 2) for e in algorithm.round_exchanges(r))


def _neighbour(problem, client=0):
    """The problem with one record of ``client``'s data replaced by a test image."""
    ds = problem.dataset
    train_x, train_y = ds.train_x.clone(), ds.train_y.clone()
    row = int(problem.partitions[client][0])
    train_x[row], train_y[row] = ds.test_x[0], (ds.test_y[0] + 1) % ds.num_classes
    return dataclasses.replace(problem, dataset=dataclasses.replace(
        ds, train_x=train_x, train_y=train_y), _cohorts={})


def _replies(problem):
    """Each exchange's reply of the node hosting client 0, round 1 then 2 (broadcasts of
    the initial model; client state carried in the node's Context)."""
    grid = InProcessGrid(None, problem.config.as_dict(), [{"partition-id": 0}])
    context: Context = grid.contexts[1]
    out = []
    algorithm = problem.algorithm
    for round in (1, 2):
        state = algorithm.begin_round(algorithm.init_server_state(problem.x0), ServerContext(
            round, Randomness(0), [0], problem.num_clients))
        for exchange in algorithm.round_exchanges(round):
            broadcast = algorithm.broadcast(exchange.name, state, round)
            msg = Message(RecordDict({"broadcast": to_record(broadcast), "config": ConfigRecord(
                {"exchange": exchange.name, "round": round, "clients": [0]})}), 1,
                MessageType.TRAIN)
            out.append(reply(msg, context, problem).content)
    return out


def _bound(problem, release, upload, key) -> float:
    """How far one replaced record can move an upload under the same noise: twice its
    release's radius (a replacement is a removal and an addition); for the local model after
    one noisy DP-SGD step at the radius the server sends (K = 1 here), η times the step's 2C/b
    at the initial radius C = clip, and for SCAFFOLD's control-variate change (x − y)/(Kη) − c,
    the step's 2C/b itself."""
    if release.radius is not None:
        return RELATIONS["replace-one"] * release.radius
    hp = problem.algorithm.hp
    assert upload.post_processing and hp.local_steps == 1
    step = RELATIONS["replace-one"] * hp.clip / hp.batch_size
    return step if key == "dc" else hp.learning_rate * step


@pytest.mark.parametrize("name, extra", LOCAL, ids=LOCAL_IDS)
def test_neighbouring_datasets_under_huge_noise_give_replies_within_the_sensitivity(name, extra,
                                                                                   tmp_path):
    """Noise 10⁴ times the sensitivity, the same seed (so the same noise): the two replies may
    differ only in noised arrays, and only by f(D) − f(D'), at most the sensitivity. An exact
    statistic of the data (a loss, a norm, a count) in a reply breaks it. (Central DP protects
    whole clients and sends clipped updates un-noised by design: not a record-level case.)"""
    config = RunConfig({**base(name), **extra, "algorithm": name, "noise-multiplier": 1e4,
                        "results-dir": str(tmp_path)})
    problem = build_problem(config)
    neighbour = _neighbour(problem)
    assert not torch.equal(problem.cohort([0]).x, neighbour.cohort([0]).x)
    releases = {r.name: r for r in problem.releases(0)}
    uploads = {key: upload for e in problem.algorithm.exchanges
               for key, upload in e.uploads.items()}
    for ours, theirs in zip(_replies(problem), _replies(neighbour), strict=True):
        assert list(ours) == list(theirs)
        for record_name in ours:
            a, b = ours[record_name], theirs[record_name]
            assert type(a) is type(b) and list(a) == list(b)
            if not isinstance(a, ArrayRecord):
                assert dict(a) == dict(b), record_name  # nothing un-noised may differ
                continue
            for key in a:
                diff = torch.from_numpy(a[key].numpy()).double() - torch.from_numpy(
                    b[key].numpy()).double()
                bound = _bound(problem, releases[uploads[key].release], uploads[key], key)
                # float32 rounding of values 10⁴ times the sensitivity adds a few percent
                assert torch.linalg.vector_norm(diff).item() <= 1.1 * bound, key


@pytest.mark.parametrize("name", ["dpsgd-gc", "clip21-sgd2m"])
def test_the_neighbour_check_catches_exact_statistics_in_a_reply(name, tmp_path):
    """The defect the boundary fixes, reproduced: with the statistics clients used to send
    (now only under non-private-diagnostics), two neighbouring datasets give replies that
    differ outside the noised arrays, under noise 10⁴ times the sensitivity and the same seed:
    the check above fails on such a reply."""
    config = RunConfig({**BASE, "algorithm": name, "noise-multiplier": 1e4,
                        "non-private-diagnostics": True, "results-dir": str(tmp_path)})
    problem = build_problem(config)
    leaked = [record_name
              for ours, theirs in zip(_replies(problem), _replies(_neighbour(problem)),
                                      strict=True)
              for record_name in ours
              if not isinstance(ours[record_name], ArrayRecord)
              and dict(ours[record_name]) != dict(theirs[record_name])]
    assert leaked and all(r.startswith("diagnostics.") for r in leaked)


@pytest.mark.parametrize("name", NOISE_FREE)
def test_a_noise_free_ablation_declares_that_it_protects_nothing(name, tmp_path):
    """An algorithm that adds no noise (an ablation) releases at multiplier 0, and its results
    say there is no guarantee against the server (ε = ∞)."""
    from dpfl.engine import run

    summary = run(RunConfig({**BASE, "algorithm": name, "num-server-rounds": 1,
                             "results-dir": str(tmp_path)}), echo=False)
    assert summary["privacy"]["guarantee_against_server"] is False
    assert summary["epsilon_max"] == float("inf")
