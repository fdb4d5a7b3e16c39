"""On a machine with a CUDA GPU: every algorithm family, per-sample clipping and ``device="auto"``
on the GPU, against the same computation on the CPU.

The noise, batches and client samples are drawn on the CPU from the same keyed streams whatever
the device (:class:`dpfl.privacy.Randomness`), so a run on the GPU differs from the CPU run only
by the float rounding of its kernels: models agree to a relative tolerance, not bit for bit.
Without a GPU those tests are skipped, with the reason; the refusal of ``device="cuda"`` runs
everywhere.
"""

from __future__ import annotations

import pytest
import torch

from dpfl.engine import run
from dpfl.errors import ConfigError
from dpfl.models import FlatModel, build_model
from dpfl.problem import resolve_device
from dpfl.runconfig import RunConfig

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

# one algorithm of each family, with what it needs on digits
FAMILIES = {"clip21-sgd2m": {}, "dpsgd-gc": {}, "prisma": {}, "adaptdp-fedavg": {},
            "dp-fedavg-quantile": {}, "dp-scaffold": {}, "pcdp-sgd": {}}


@gpu
@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_every_family_runs_on_the_gpu_as_on_the_cpu(algorithm, small_config, tmp_path):
    models, epsilons = {}, {}
    for device in ("cpu", "cuda"):
        summary = run(small_config(algorithm=algorithm, device=device, run_name=device,
                                   num_server_rounds=2, **FAMILIES[algorithm]), echo=False)
        models[device] = torch.load(tmp_path / "results" / device / "model.pt")
        epsilons[device] = summary["epsilon"]
        assert summary["rounds_completed"] == 2
    assert epsilons["cuda"] == epsilons["cpu"]  # the ledger does not depend on the device
    for key, cpu in models["cpu"].items():
        torch.testing.assert_close(models["cuda"][key].cpu(), cpu, rtol=1e-4, atol=1e-5)


@gpu
def test_auto_picks_the_gpu():
    assert resolve_device(RunConfig({"device": "auto"})).type == "cuda"


@gpu
@pytest.mark.parametrize("name", ["mlp", "clip21-cnn"])
def test_per_sample_clipping_on_the_gpu_matches_the_cpu(name):
    model = FlatModel(build_model(name, input_shape=(1, 28, 28), num_classes=10, seed=0),
                      "cross-entropy")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (3, 32), generator=gen)
    flat = model.initial_params().repeat(3, 1)
    cpu, cpu_norms = model.clipped_mean(flat, x, y, 0.5)
    gpu, gpu_norms = model.clipped_mean(flat.cuda(), x.cuda(), y.cuda(), 0.5)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu_norms.cpu(), cpu_norms, rtol=1e-4, atol=1e-6)


def test_cuda_is_refused_in_one_line_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available") as refused:
        resolve_device(RunConfig({"device": "cuda"}))
    assert refused.value.key == "device" and "\n" not in str(refused.value)
    assert resolve_device(RunConfig({"device": "auto"})).type == "cpu"
