"""Datasets (real files, torchvision, synthetic problems) and their split over clients.

``load_dataset(name, seed=...)`` returns a :class:`Dataset` of dense tensors;
``partition(dataset, partitioner=..., num_partitions=..., seed=...)`` splits its
training rows with flwr-datasets' partitioners. Registered names are listed by
``DATASETS.names()`` and ``PARTITIONERS.names()``.
"""

# imported for their side effect: each module registers its loaders
from dpfl.datasets import (  # noqa: F401
    arrays,
    bank,
    digits,
    leaf_synthetic,
    libsvm,
    synthetic,
    vision,
)
from dpfl.datasets.base import Dataset, natural_partition
from dpfl.datasets.loading import DATASETS, load_dataset
from dpfl.datasets.partition import PARTITIONERS, partition

__all__ = ["DATASETS", "PARTITIONERS", "Dataset", "load_dataset", "natural_partition", "partition"]
