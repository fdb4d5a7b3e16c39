"""dpfl.datasets: the real datasets' known counts, synthetic problems, partitioners, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from dpfl.datasets import DATASETS, PARTITIONERS, load_dataset, natural_partition, partition
from dpfl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = os.environ["DPFL_DATA_DIR"]  # set by conftest


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh torchvision cache, so that every run goes through the local files."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("dpfl-cache")
        patch.setenv("DPFL_CACHE_DIR", str(folder))
        yield folder


def _offline(*args: object, **kwargs: object) -> None:
    raise AssertionError("a dataset loader tried to use the network")


@pytest.fixture(scope="module")
def mnist(cache_dir: Path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(urllib.request, "urlopen", _offline)
        return load_dataset("mnist", seed=0, data_dir=DATA_DIR)


@pytest.fixture(scope="module")
def fashion(cache_dir: Path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(urllib.request, "urlopen", _offline)
        return load_dataset("fashion-mnist", seed=0, data_dir=DATA_DIR)


def load(name: str, seed: int = 0, **options):
    return load_dataset(name, seed=seed, data_dir=DATA_DIR, **options)


def assert_disjoint_and_sorted(parts: list[np.ndarray]) -> np.ndarray:
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)
    every = np.concatenate(parts)
    assert len(np.unique(every)) == len(every)
    return every


# --- real datasets: sizes, shapes, dtypes, labels -------------------------------------------------


def test_registered_dataset_names():
    assert DATASETS.names() == sorted(
        [
            "a9a",
            "bank-marketing",
            "cifar10",
            "digits",
            "duke",
            "fashion-mnist",
            "leaf-synthetic",
            "leukemia",
            "mnist",
            "npz",
            "prisma-least-squares",
            "quadratic",
            "synthetic-cifar10",
            "w8a",
        ]
    )


def test_mnist_sizes_shapes_labels_and_normalisation(mnist):
    assert (mnist.train_x.shape, mnist.test_x.shape) == ((60000, 1, 28, 28), (10000, 1, 28, 28))
    assert mnist.input_shape == (1, 28, 28)
    assert mnist.train_x.dtype == torch.float32 and mnist.train_y.dtype == torch.int64
    assert (mnist.task, mnist.num_classes) == ("classification", 10)
    assert mnist.train_y.bincount().tolist()[:2] == [5923, 6742]
    assert (mnist.test_y.bincount().min(), mnist.test_y.bincount().max()) == (892, 1135)
    assert abs(mnist.train_x.mean().item()) < 0.01 and abs(mnist.train_x.std().item() - 1) < 0.01


def test_raw_pixels_are_the_idx_values_unscaled(mnist):
    unit = load_dataset("mnist", seed=0, data_dir=DATA_DIR, num_train=300, scaling="unit")
    raw = load_dataset("mnist", seed=0, data_dir=DATA_DIR, num_train=300, scaling="raw")
    assert torch.equal(raw.train_y, unit.train_y)  # the same subset
    assert torch.equal(raw.train_x, raw.train_x.round()) and raw.train_x.max() == 255
    assert torch.allclose(raw.train_x / 255, unit.train_x, atol=1e-7)
    with pytest.raises(ConfigError, match="allowed: standardised, unit, raw"):
        load_dataset("mnist", seed=0, data_dir=DATA_DIR, scaling="bytes")


def test_mnist_is_read_from_the_data_folder_through_links(mnist, cache_dir):
    raw = cache_dir / "MNIST" / "raw"
    for name in ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        assert (raw / name).is_symlink()
        assert (raw / name).resolve() == (Path(DATA_DIR) / "mnist" / name).resolve()


def test_fashion_mnist_has_6000_train_and_1000_test_images_per_class(fashion):
    assert fashion.train_x.shape == (60000, 1, 28, 28)
    assert fashion.train_y.bincount().tolist() == [6000] * 10
    assert fashion.test_y.bincount().tolist() == [1000] * 10
    assert (
        abs(fashion.train_x.mean().item()) < 0.01 and abs(fashion.train_x.std().item() - 1) < 0.01
    )


def test_repeated_loads_return_the_cached_object(mnist):
    assert load_dataset("mnist", seed=5, data_dir=DATA_DIR) is mnist
    assert load("a9a") is load("a9a")


def test_a9a_sizes_labels_and_unit_rows():
    a9a = load("a9a")
    assert (a9a.train_x.shape, a9a.test_x.shape) == ((32561, 123), (16281, 123))
    assert (a9a.task, a9a.num_classes, a9a.train_y.dtype) == ("binary", 1, torch.float32)
    assert set(a9a.train_y.unique().tolist()) == {-1.0, 1.0}
    assert int((a9a.train_y > 0).sum()) == 7841 and int((a9a.test_y > 0).sum()) == 3846
    assert torch.allclose(a9a.train_x.norm(dim=1), torch.ones(32561))


def test_libsvm_normalize_false_keeps_the_raw_binary_features():
    raw = load("a9a", normalize=False)
    assert set(raw.train_x.unique().tolist()) == {0.0, 1.0}
    assert raw.train_x.sum(dim=1).max() == 14


def test_duke_is_44_by_7129_and_tested_on_its_training_set():
    duke = load("duke")
    assert duke.train_x.shape == (44, 7129) and int((duke.train_y > 0).sum()) == 23
    assert duke.test_x is duke.train_x and duke.test_y is duke.train_y


def test_leukemia_is_38_training_and_34_test_rows_or_all_72_joined():
    """leu: 11 AML (−1), 27 ALL (+1); leu.t: 14 and 20 (the data folder's README); joined, the
    test rows follow the training rows and every row is tested."""
    leukemia = load("leukemia")
    assert leukemia.train_x.shape == (38, 7129) and leukemia.test_x.shape == (34, 7129)
    assert int((leukemia.train_y > 0).sum()) == 27 and int((leukemia.test_y > 0).sum()) == 20
    joined = load("leukemia", join_test=True)
    assert torch.equal(joined.train_x, torch.cat([leukemia.train_x, leukemia.test_x]))
    assert joined.test_x is joined.train_x
    with pytest.raises(ConfigError, match="join_test"):
        load("duke", join_test=True)
    with pytest.raises(ConfigError, match="num_validation"):
        load("leukemia", join_test=True, num_validation=5)


def test_w8a_is_49749_by_300_with_1479_positives():
    w8a = load("w8a")
    assert w8a.train_x.shape == (49749, 300) and int((w8a.train_y > 0).sum()) == 1479
    assert w8a.test_x is w8a.train_x


def test_bank_marketing_has_51_features_and_5289_positives():
    bank = load("bank-marketing")
    assert bank.train_x.shape == (45211, 51) and bank.train_x.dtype == torch.float32
    assert (bank.task, bank.num_classes) == ("classification", 2)
    assert int(bank.train_y.sum()) == 5289
    numeric, onehot = bank.train_x[:, :7], bank.train_x[:, 7:]
    assert torch.allclose(numeric.mean(0), torch.zeros(7), atol=1e-4)
    assert torch.allclose(numeric.std(0, unbiased=False), torch.ones(7), atol=1e-4)
    assert torch.equal(
        onehot.sum(1), torch.full((45211,), 9.0)
    )  # one category of each of 9 attributes


def test_bank_marketing_test_set_is_a_seeded_tenth_of_the_rows():
    bank, again, other = (
        load("bank-marketing", 1),
        load("bank-marketing", 1),
        load("bank-marketing", 2),
    )
    assert bank.test_x.shape == (4521, 51)
    assert torch.equal(bank.test_x, again.test_x) and not torch.equal(bank.test_x, other.test_x)
    rows = {tuple(r) for r in bank.train_x.tolist()}
    assert all(tuple(r) in rows for r in bank.test_x.tolist())  # drawn from the training rows


def test_digits_is_a_seeded_stratified_80_20_split_of_1797_images():
    digits = load("digits", seed=3)
    assert (digits.train_x.shape, digits.test_x.shape) == ((1437, 64), (360, 64))
    assert 0 <= digits.train_x.min() and digits.train_x.max() == 1
    test_share = digits.test_y.bincount() / (digits.test_y.bincount() + digits.train_y.bincount())
    assert torch.all((test_share - 0.2).abs() < 0.01)
    assert torch.equal(load("digits", seed=3).test_x, digits.test_x)
    assert not torch.equal(load("digits", seed=4).test_x, digits.test_x)


# --- synthetic problems ---------------------------------------------------------------------------


def test_prisma_least_squares_follows_section_5_1():
    data = load("prisma-least-squares", seed=1)
    assert data.train_x.shape == (20000, 10) and data.test_x.shape == (2000, 10)
    assert (data.task, data.train_y.dtype, data.client_sizes) == (
        "regression",
        torch.float32,
        (2000,) * 10,
    )
    assert data.train_x.abs().max() <= 1
    x64, y64 = data.train_x.double(), data.train_y.double()
    solution = torch.linalg.lstsq(x64, y64.unsqueeze(1)).solution
    residual = y64 - (x64 @ solution).squeeze(1)
    assert abs(residual.var().item() - 2.0) < 0.1  # φ ~ N(0, 2): variance 2


def test_prisma_duplicate_repeats_each_clients_rows():
    base = load("prisma-least-squares", seed=1, num_clients=3, samples_per_client=50)
    doubled = load(
        "prisma-least-squares", seed=1, num_clients=3, samples_per_client=50, duplicate=2
    )
    assert doubled.client_sizes == (100, 100, 100)
    for i, rows in enumerate(natural_partition(doubled)):
        assert torch.equal(doubled.train_x[rows], base.train_x[i * 50 : (i + 1) * 50].repeat(2, 1))


def test_quadratic_targets_interpolate_at_a_reference_of_norm_sqrt_7_8():
    data = load("quadratic", seed=2)
    assert (data.train_x.shape, data.test_x.shape, data.task) == (
        (3000, 100),
        (1000, 100),
        "regression",
    )
    b = torch.linalg.lstsq(
        data.train_x.double(), data.train_y.double().unsqueeze(1)
    ).solution.squeeze(1)
    assert abs(b.norm().item() - 7.8**0.5) < 1e-3
    assert torch.allclose(data.test_x.double() @ b, data.test_y.double(), atol=1e-3)
    assert abs(0.5 * data.train_y.pow(2).mean().item() - 3.9) < 0.5  # f(0) ≈ ½‖b‖²


@pytest.mark.parametrize("name", ["prisma-least-squares", "quadratic"])
def test_synthetic_data_is_fixed_by_the_seed(name):
    first, again, other = (
        load(name, seed=7, dim=5),
        load(name, seed=7, dim=5),
        load(name, seed=8, dim=5),
    )
    assert first is again
    assert torch.equal(
        first.train_x, DATASETS.get(name)(seed=7, dim=5).train_x
    )  # a fresh, uncached draw
    assert not torch.equal(first.train_x, other.train_x)
    assert not torch.equal(first.train_x[: len(first.test_x)], first.test_x)


def test_natural_partition_only_for_datasets_that_have_one(mnist):
    data = load("prisma-least-squares", seed=0, num_clients=4, samples_per_client=10)
    assert [p.tolist() for p in natural_partition(data)] == [
        list(range(i * 10, i * 10 + 10)) for i in range(4)
    ]
    assert natural_partition(mnist) is None


# --- partitioners ---------------------------------------------------------------------------------

COVERING = [
    ("iid", {}),
    ("contiguous", {}),
    ("dirichlet", {"alpha": 0.3}),
    ("dirichlet", {"alpha": 100.0}),
]


def test_registered_partitioner_names():
    assert PARTITIONERS.names() == ["contiguous", "dirichlet", "iid", "natural", "shards"]


@pytest.mark.parametrize(("name", "options"), COVERING)
def test_partitions_are_disjoint_and_cover_every_row(mnist, name, options):
    parts = partition(mnist, partitioner=name, num_partitions=20, seed=0, **options)
    assert len(parts) == 20 and min(map(len, parts)) > 0
    assert np.array_equal(np.sort(assert_disjoint_and_sorted(parts)), np.arange(60000))


def test_iid_sizes_differ_by_at_most_one_and_rows_are_shuffled():
    digits = load("digits")
    parts = partition(digits, partitioner="iid", num_partitions=10, seed=0)
    assert sorted({len(p) for p in parts}) == [143, 144]
    assert not np.array_equal(parts[0], np.arange(len(parts[0])))


def test_contiguous_cuts_blocks_in_file_order():
    duke = load("duke")
    parts = partition(duke, partitioner="contiguous", num_partitions=4, seed=0)
    assert [p.tolist() for p in parts] == [list(range(i * 11, i * 11 + 11)) for i in range(4)]


def test_shards_give_equal_partitions_of_few_labels(mnist):
    parts = partition(
        mnist, partitioner="shards", num_partitions=100, seed=0, shards_per_partition=2
    )
    assert_disjoint_and_sorted(parts)
    assert {len(p) for p in parts} == {600}
    labels = [len(np.unique(mnist.train_y.numpy()[p])) for p in parts]
    assert (
        max(labels) <= 4 and np.mean(labels) < 2.5
    )  # a shard of 300 rows straddles at most 2 labels


def test_shards_leave_out_the_rows_that_do_not_fill_a_shard():
    digits = load("digits")  # 1437 rows, 20 shards of 71 rows
    parts = partition(digits, partitioner="shards", num_partitions=10, seed=0)
    assert len(assert_disjoint_and_sorted(parts)) == 20 * 71


def test_small_dirichlet_alpha_skews_label_histograms(mnist):
    def dominant_share(alpha: float) -> float:
        parts = partition(mnist, partitioner="dirichlet", num_partitions=10, seed=0, alpha=alpha)
        return float(np.mean([np.bincount(mnist.train_y.numpy()[p]).max() / len(p) for p in parts]))

    assert dominant_share(0.1) > 0.5
    assert dominant_share(1000.0) < 0.15


def test_dirichlet_splits_binary_labels_as_two_classes():
    a9a = load("a9a")
    parts = partition(a9a, partitioner="dirichlet", num_partitions=10, seed=0, alpha=0.1)
    positive = [float((a9a.train_y[p] > 0).float().mean()) for p in parts]
    assert max(positive) - min(positive) > 0.5


def test_natural_partitioner_returns_the_client_blocks():
    data = load("prisma-least-squares", seed=0, num_clients=5, samples_per_client=20)
    parts = partition(data, partitioner="natural", num_partitions=5, seed=9)
    assert [p.tolist() for p in parts] == [p.tolist() for p in natural_partition(data)]


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards"])
def test_partition_is_fixed_by_the_seed(name):
    digits = load("digits")
    first = partition(digits, partitioner=name, num_partitions=8, seed=11)
    again = partition(digits, partitioner=name, num_partitions=8, seed=11)
    other = partition(digits, partitioner=name, num_partitions=8, seed=12)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.slow
def test_partition_is_a_pure_function_across_processes():
    """A fresh process splits as this one does; there flwr-datasets' partitioners come without
    the package's visualisation and metrics (seaborn), and a later import of the package is
    whole and splits the same."""
    script = f"""
import json, sys
from dpfl.datasets import load_dataset, partition
module = sys.modules["dpfl.datasets.partition"]  # the package's name "partition" is the function
d = load_dataset("digits", seed=0, data_dir={DATA_DIR!r})
names = ("iid", "dirichlet", "shards")
split = {{n: partition(d, partitioner=n, num_partitions=6, seed=4) for n in names}}
assert not {{"seaborn", "flwr_datasets"}} & set(sys.modules), "imported"
import flwr_datasets
assert flwr_datasets.FederatedDataset and flwr_datasets.partitioner is module.partitioners()
module.partitioners.cache_clear(), module._split.cache_clear()
again = {{n: partition(d, partitioner=n, num_partitions=6, seed=4) for n in names}}
assert all((a == b).all() for n in names for a, b in zip(split[n], again[n], strict=True))
print(json.dumps({{n: [p.tolist() for p in parts] for n, parts in split.items()}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "123",
             "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    digits = load("digits")
    for name, parts in fresh.items():
        here = partition(digits, partitioner=name, num_partitions=6, seed=4)
        assert [p.tolist() for p in here] == parts


def test_changing_a_returned_partition_does_not_change_the_next_result():
    parts = partition(load("digits"), partitioner="iid", num_partitions=3, seed=0)
    first = parts[0][0]
    parts[0][0] = -1
    assert partition(load("digits"), partitioner="iid", num_partitions=3, seed=0)[0][0] == first


# --- errors ---------------------------------------------------------------------------------------


def test_missing_mnist_without_download_names_the_folder(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_dataset("mnist", seed=0, data_dir=str(tmp_path))
    assert error.value.key == "dataset"
    message = str(error.value)
    assert (
        str(tmp_path / "mnist") in message
        and "DPFL_DATA_DIR" in message
        and "download=true" in message
    )


def test_missing_cifar10_without_download_is_a_config_error():
    with pytest.raises(ConfigError, match="cifar10") as error:
        load_dataset("cifar10", seed=0, data_dir=DATA_DIR)
    assert error.value.key == "dataset"


def test_missing_local_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="libsvm/a9a") as error:
        load_dataset("a9a", seed=0, data_dir=str(tmp_path))
    assert error.value.key == "dataset"
    with pytest.raises(ConfigError, match="no download source") as error:
        load_dataset("bank-marketing", seed=0, data_dir=str(tmp_path), download=True)
    assert error.value.key == "download"


def _arrays(path, n=60, m=20, **extra):
    rng = np.random.default_rng(0)
    arrays = {"train_x": rng.normal(size=(n, 3, 4)), "train_y": rng.integers(0, 3, n),
              "test_x": rng.normal(size=(m, 3, 4)), "test_y": rng.integers(0, 3, m)}
    np.savez(path, **{**arrays, **extra})
    return arrays


def test_a_users_npz_is_read_as_float32_features_and_int64_classes(tmp_path):
    arrays = _arrays(tmp_path / "mine.npz")
    data = load_dataset("npz", seed=0, path=str(tmp_path / "mine.npz"))
    assert (data.name, data.task, data.num_classes, data.input_shape) == (
        "npz", "classification", 3, (3, 4))
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert torch.equal(data.train_x, torch.from_numpy(arrays["train_x"].astype(np.float32)))
    assert torch.equal(data.test_y, torch.from_numpy(arrays["test_y"]))
    # a relative path is read from the data folder; held-out splits as for every dataset
    held = load_dataset("npz", seed=1, data_dir=str(tmp_path), path="mine.npz", num_public=5,
                        num_validation=10)
    assert (held.num_public, held.num_validation, held.num_train) == (5, 10, 45)
    _arrays(tmp_path / "k.npz", num_classes=7)
    assert load_dataset("npz", seed=0, path=str(tmp_path / "k.npz")).num_classes == 7


@pytest.mark.parametrize("task, labels", [("binary", [-1.0, 1.0]), ("regression", [0.5, -2.5])])
def test_a_users_npz_poses_a_binary_or_regression_task(tmp_path, task, labels):
    y = np.resize(np.array(labels), 60)
    _arrays(tmp_path / "t.npz", train_y=y, test_y=y[:20], task=task)
    data = load_dataset("npz", seed=0, path=str(tmp_path / "t.npz"))
    assert (data.task, data.num_classes, data.train_y.dtype) == (task, 1, torch.float32)
    assert data.train_y.tolist() == y.tolist()


@pytest.mark.parametrize("extra, message", [
    ({"train_x": None}, "lacks train_x"),
    ({"test_x": np.zeros((20, 4, 3))}, "one input shape for both"),
    ({"train_x": np.zeros(60)}, r"train_x must be real numbers \[n, \*input_shape\]"),
    ({"test_x": np.full((20, 3, 4), np.nan)}, "NaN"),
    ({"train_y": np.zeros(59, dtype=int)}, r"one label per row, shape \(60,\)"),
    ({"train_y": np.full(60, 0.5)}, "classification labels are integers"),
    ({"test_y": np.full(20, -1)}, "classification labels are integers"),
    ({"num_classes": 2}, "the labels reach 2, num_classes is 2"),
    ({"task": "ranking"}, "task 'ranking' is not a task"),
    ({"task": "binary"}, "binary labels are -1 and \\+1"),
    ({"train_x": np.array(["a"] * 60).reshape(60, 1)}, "real numbers"),
])
def test_a_bad_npz_is_one_config_error_naming_dataset_options(tmp_path, extra, message):
    arrays = _arrays(tmp_path / "ok.npz")
    np.savez(tmp_path / "bad.npz", **{k: v for k, v in {**arrays, **extra}.items()
                                      if v is not None})
    with pytest.raises(ConfigError, match=message) as error:
        load_dataset("npz", seed=0, path=str(tmp_path / "bad.npz"))
    assert error.value.key == "dataset-options" and "\n" not in str(error.value)


def test_the_data_guides_own_data_command_runs_as_written(tmp_path, monkeypatch):
    import shlex

    from dpfl.cli import main

    guide = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    section = guide[guide.index("### Your own data"):guide.index("### Held-out splits")]
    (line,) = [c for c in section.splitlines() if c.startswith("dpfl run")]
    (tmp_path / "data").mkdir()
    _arrays(tmp_path / "data" / "mine.npz", n=1200)  # in the data folder, as the guide says
    monkeypatch.setenv("DPFL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(line)[1:]) == 0
    (summary,) = tmp_path.glob("results/*/summary.json")
    assert "validation_accuracy" in json.loads(summary.read_text())


def test_an_npz_that_is_not_there_or_not_one_or_pickled_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="give path=FILE"):
        load_dataset("npz", seed=0)
    with pytest.raises(ConfigError, match="does not exist .a relative path is read from the "
                       "data folder"):
        load_dataset("npz", seed=0, data_dir=str(tmp_path), path="absent.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ConfigError, match="not a readable .npz"):
        load_dataset("npz", seed=0, path=str(tmp_path / "text.npz"))
    arrays = _arrays(tmp_path / "ok.npz")
    np.savez(tmp_path / "pickled.npz", **{**arrays, "train_y": np.array([object()] * 60)})
    with pytest.raises(ConfigError, match="without pickles"):
        load_dataset("npz", seed=0, path=str(tmp_path / "pickled.npz"))


def test_unknown_dataset_lists_the_registered_names():
    with pytest.raises(ConfigError, match="mnist") as error:
        load_dataset("imagenet", seed=0)
    assert error.value.key == "dataset"


def test_unknown_or_invalid_dataset_option_is_a_config_error():
    with pytest.raises(ConfigError, match="num-samples") as error:
        load_dataset("quadratic", seed=0, num_clients=3)
    assert error.value.key == "num-clients"
    with pytest.raises(ConfigError) as error:
        load_dataset("prisma-least-squares", seed=0, duplicate=0)
    assert error.value.key == "duplicate"


def test_unknown_partitioner_lists_the_registered_names():
    with pytest.raises(ConfigError, match="dirichlet") as error:
        partition(load("digits"), partitioner="pathological", num_partitions=2, seed=0)
    assert error.value.key == "partitioner"


@pytest.mark.parametrize("count", [0, -1, 1438])
def test_partition_count_outside_one_to_n_is_a_config_error(count):
    with pytest.raises(ConfigError, match="1..1437") as error:
        partition(load("digits"), partitioner="iid", num_partitions=count, seed=0)
    assert error.value.key == "num-partitions"


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_non_positive_alpha_is_a_config_error(alpha):
    with pytest.raises(ConfigError) as error:
        partition(load("digits"), partitioner="dirichlet", num_partitions=2, seed=0, alpha=alpha)
    assert error.value.key == "alpha"


def test_dirichlet_that_cannot_fill_every_partition_is_a_config_error(recwarn):
    with pytest.raises(ConfigError, match="larger alpha") as error:
        partition(load("duke"), partitioner="dirichlet", num_partitions=44, seed=0, alpha=0.01)
    assert error.value.key == "num-partitions"
    # flwr-datasets' own warning before it gives up is not shown: the one line says it all
    assert not [w for w in recwarn if "min_partition_size" in str(w.message)]


def test_too_many_shards_is_a_config_error():
    with pytest.raises(ConfigError) as error:
        partition(
            load("duke"), partitioner="shards", num_partitions=4, seed=0, shards_per_partition=12
        )
    assert error.value.key == "shards-per-partition"


@pytest.mark.parametrize("name", ["dirichlet", "shards"])
def test_label_partitioners_refuse_regression_data(name):
    with pytest.raises(ConfigError) as error:
        partition(load("quadratic"), partitioner=name, num_partitions=2, seed=0)
    assert (
        error.value.key == "partitioner"
        and "iid" in error.value.allowed
        and "dirichlet" not in error.value.allowed
    )


def test_natural_partitioner_errors(mnist):
    with pytest.raises(ConfigError, match="no natural") as error:
        partition(mnist, partitioner="natural", num_partitions=10, seed=0)
    assert error.value.key == "partitioner"
    with pytest.raises(ConfigError) as error:
        partition(load("prisma-least-squares"), partitioner="natural", num_partitions=3, seed=0)
    assert error.value.key == "num-partitions"


def test_synthetic_cifar10_is_cifar_shaped_seeded_and_bounded():
    one = load_dataset("synthetic-cifar10", seed=4, num_train=60, num_test=20)
    again = load_dataset("synthetic-cifar10", seed=4, num_train=60, num_test=20)
    assert one.train_x.shape == (60, 3, 32, 32) and one.test_x.shape == (20, 3, 32, 32)
    assert one.train_x.dtype == torch.float32 and one.train_y.dtype == torch.int64
    assert one.train_x.abs().max() <= 1.0 and set(one.train_y.tolist()) <= set(range(10))
    assert torch.equal(one.train_x, again.train_x)


def test_leaf_synthetic_draws_each_client_from_its_own_stream():
    """Synthetic(α, β): a client's samples do not depend on the population's size, the
    natural split is one block per client, each client keeps test samples, and the labels
    follow each client's own model (clients disagree at α = β = 1)."""
    from dpfl.datasets.leaf_synthetic import client_samples

    small = load_dataset("leaf-synthetic", seed=4, num_clients=10, max_samples=200)
    large = load_dataset("leaf-synthetic", seed=4, num_clients=20, max_samples=200)
    assert len(small.client_sizes) == 10 and len(large.client_sizes) == 20
    assert large.client_sizes[:10] == small.client_sizes
    assert torch.equal(large.train_x[:small.num_train], small.train_x)
    assert small.train_x.shape[1] == 60 and small.num_classes == 10
    assert len(small.test_y) >= 10 and small.validation_y is None
    x, y = client_samples(4, 3, alpha=1.0, beta=1.0, dim=60, classes=10, max_samples=200)
    start = sum(small.client_sizes[:3])
    assert torch.equal(small.train_x[start:start + small.client_sizes[3]],
                       torch.from_numpy(x[:small.client_sizes[3]]))
    other = load_dataset("leaf-synthetic", seed=5, num_clients=10, max_samples=200)
    assert not torch.equal(other.train_x[:50], small.train_x[:50])
    split = load_dataset("leaf-synthetic", seed=4, num_clients=10, max_samples=200,
                         validation_fraction=0.2)
    assert split.num_validation > 0 and split.num_train < small.num_train
    with pytest.raises(ConfigError, match="test-fraction"):
        load_dataset("leaf-synthetic", seed=4, test_fraction=1.5)


def _unseen_clients_accuracy(dataset, train_clients: int) -> float:
    """A logistic model fitted on the first ``train_clients`` clients' rows, scored on the
    others' (clients it never saw)."""
    cut = sum(dataset.client_sizes[:train_clients])
    x, y = dataset.train_x, dataset.train_y
    model = torch.nn.Linear(x.shape[1], dataset.num_classes)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=200)

    def loss():
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(model(x[:cut]), y[:cut])
        value.backward()
        return value

    optimizer.step(loss)
    return (model(x[cut:]).argmax(1) == y[cut:]).float().mean().item()


def test_leaf_synthetic_iid_shares_one_model_a_population_can_learn():
    """Synthetic IID labels every client by one (W, b) from the seed's own stream, with the
    clients' counts unchanged; a global model fitted on some clients then predicts unseen
    clients well, while under Synthetic(1, 1) each client's own model leaves it near chance."""
    from dpfl.datasets.leaf_synthetic import shared_model

    iid = load_dataset("leaf-synthetic", seed=4, num_clients=60, max_samples=200, iid=True)
    own = load_dataset("leaf-synthetic", seed=4, num_clients=60, max_samples=200)
    assert iid.client_sizes == own.client_sizes
    weights, bias = shared_model(4, 60, 10)
    labels = (iid.train_x.double() @ torch.from_numpy(weights).T
              + torch.from_numpy(bias)).argmax(1)
    assert torch.equal(labels, iid.train_y)
    assert _unseen_clients_accuracy(iid, 40) > 0.8
    assert _unseen_clients_accuracy(own, 40) < 0.3
    with pytest.raises(ConfigError, match="iid"):
        load_dataset("leaf-synthetic", seed=4, iid="yes")
