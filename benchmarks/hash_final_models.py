"""SHA-256 of the final model of every registered algorithm after 3 rounds, on the digits MLP
and on the Clip21 CNN (MNIST): a change to the per-sample engine that claims to change no bit
is checked by running this before and after it and comparing the lines.

    DPFL_DATA_DIR=<data folder> python benchmarks/hash_final_models.py [--only NAME ...]

One line per (model, algorithm): the hash of the saved ``model.pt`` tensors (in ``state_dict``
order, each as its dtype, shape and raw bytes), or the one-line error of a run the algorithm
refuses in this setting.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile

import torch

from dpfl.algorithms import ALGORITHMS
from dpfl.engine import run
from dpfl.runconfig import RunConfig

#: (label, run-config values): the default digits MLP, and the Clip21 CNN on MNIST (28×28)
SETTINGS = {
    "digits-mlp": {"dataset": "digits", "model": "mlp"},
    "mnist-clip21-cnn": {"dataset": "mnist", "model": "clip21-cnn"},
}


def model_hash(path: str) -> str:
    """SHA-256 over the saved model's tensors: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in torch.load(path).items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def final_hash(algorithm: str, values: dict[str, object], folder: str) -> str:
    config = RunConfig({"algorithm": algorithm, "num-partitions": 4, "num-server-rounds": 3,
                        "batch-size": 16, "results-dir": folder, "run-name": algorithm,
                        "eval-every": 3, **values})
    try:
        summary = run(config, echo=False, plot=False)
    except Exception as exc:  # noqa: BLE001 - reported as the run's line
        return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return model_hash(summary["results"] + "/model.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="algorithms to run")
    args = parser.parse_args()
    for label, values in SETTINGS.items():
        for algorithm in ALGORITHMS:
            if args.only and algorithm not in args.only:
                continue
            with tempfile.TemporaryDirectory() as folder:
                print(f"{label} {algorithm} {final_hash(algorithm, values, folder)}", flush=True)


if __name__ == "__main__":
    main()
