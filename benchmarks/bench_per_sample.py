"""Cost of per-sample clipping relative to a plain training step: dpfl and Opacus.

Four steps on the same shapes (batch 64; MNIST-shaped inputs for the MLP and the Clip21 CNN,
CIFAR-shaped 3×32×32 for ResNet-20 with GroupNorm), clip radius 1, SGD with learning rate 0.1:

- plain: mean-loss ``backward()`` on the ``nn.Module`` + ``torch.optim.SGD`` step;
- dpfl: ``FlatModel.clipped_mean`` (ghost norms for Linear layers, chunked) + the SGD update on
  the flat vector;
- Opacus GradSampleModule: ``PrivacyEngine.make_private`` (hooks) with noise multiplier 0:
  per-sample gradients, clipping, sum and step in ``DPOptimizer.step``;
- Opacus ghost clipping: ``make_private(grad_sample_mode="ghost")`` with the
  ``DPLossFastGradientClipping`` criterion it returns (two backward passes), noise 0.

The candidates are timed interleaved (``common.interleaved``); each row is the median and the
spread of the per-repeat ratio to the plain step. The ``10 clients`` rows time one
``clipped_mean`` call over 10 clients × 64 samples (clients at different points) against 10
steps of each of the others. Before timing, each model's clipped mean from dpfl and from both
Opacus modes are compared at one point, at the radius that clips half of the samples (the
``vs dpfl clipped mean`` rows): they must agree to float32 rounding, or the comparison is not
like for like. Opacus clips with ``C/(‖g‖ + 1e-6)``, dpfl
with ``C/‖g‖``; the difference is ~1e-6 relative.

Joint tapes: ``FlatModel.clipped_mean`` over many small clients at one point (the one-step
families; the MLP, :data:`JOINT` shapes), and again at points of their own (rows of one
``[C, d]`` tensor, as a local step after the first), with ``joint_tapes`` on (each group's
tapes from one pass, where the first group of its layout was checked to give the same bits)
against off (a tape per client), interleaved: µs a client each, their ratio, and whether the
results were bit for bit equal and which layouts were taken jointly.

On the CPU by default; ``--device cuda`` runs every candidate on the GPU (each timed call
waits for the GPU's kernels).

    .venv/bin/python benchmarks/bench_per_sample.py [--quick] [--rows FILE] [--device cuda]
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Row, arguments, emit, interleaved, parse, ratios  # noqa: E402

from dpfl.models import FlatModel, build_model  # noqa: E402
from dpfl.models.rows import aligned_rows  # noqa: E402

SECTION = "per-sample clipping"
BATCH, LR, CLIP = 64, 0.1, 1.0
AGREEMENT = 1e-5  # max |Δ| ÷ max |value| allowed between the clipped means
# model -> (input shape, clients per timed workload, ratio target on dpfl's rows)
MODELS: dict[str, tuple[tuple[int, ...], tuple[int, ...], float | None]] = {
    "mlp": ((1, 28, 28), (1, 10), 1.5),
    "clip21-cnn": ((1, 28, 28), (1, 10), 1.5),
    "resnet20": ((3, 32, 32), (1,), None),
}
# (model, clients) -> (repeats, quick repeats): the full run takes about 1 minute on 2 idle
# cores (Opacus' GradSampleModule on the MLP is most of it)
REPEATS = {("mlp", 1): (200, 30), ("mlp", 10): (60, 10), ("clip21-cnn", 1): (100, 20),
           ("clip21-cnn", 10): (25, 5), ("resnet20", 1): (10, 3)}
OPACUS = {"Opacus GradSampleModule": "hooks", "Opacus ghost clipping": "ghost"}
JOINT = ((256, 16), (64, 32), (10, 64))  # (clients, batch) of the joint-tape rows

Step = Callable[[], None]


DEVICE = torch.device("cpu")  # --device


def _data(name: str, n_clients: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = MODELS[name][0]
    return (torch.randn(n_clients, BATCH, *shape, generator=gen).to(DEVICE),
            torch.randint(0, 10, (n_clients, BATCH), generator=gen).to(DEVICE))


def _module(name: str) -> nn.Module:
    return build_model(name, input_shape=MODELS[name][0], num_classes=10, seed=0).to(DEVICE)


def _opacus(name: str, mode: str, x: torch.Tensor, y: torch.Tensor, clip: float = CLIP
            ) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """Opacus' private (module, optimizer, criterion) for batches of ``BATCH``, noise 0."""
    module = _module(name)
    loader = DataLoader(TensorDataset(x[0], y[0]), batch_size=BATCH)  # expected batch = BATCH
    made = PrivacyEngine(accountant="rdp").make_private(
        module=module, optimizer=torch.optim.SGD(module.parameters(), lr=LR),
        data_loader=loader, noise_multiplier=0.0, max_grad_norm=clip, poisson_sampling=False,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode=mode)
    model, optimizer = made[0], made[1]
    criterion = made[2] if mode == "ghost" else F.cross_entropy
    return model, optimizer, criterion


def _opacus_step(name: str, mode: str, x: torch.Tensor, y: torch.Tensor) -> Step:
    model, optimizer, criterion = _opacus(name, mode, x, y)

    def step() -> None:
        for c in range(len(x)):
            optimizer.zero_grad()
            criterion(model(x[c]), y[c]).backward()
            optimizer.step()

    return step


def _plain_step(name: str, x: torch.Tensor, y: torch.Tensor) -> Step:
    model = _module(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        for c in range(len(x)):
            optimizer.zero_grad()
            F.cross_entropy(model(x[c]), y[c]).backward()
            optimizer.step()

    return step


def _dpfl_step(name: str, x: torch.Tensor, y: torch.Tensor) -> Step:
    flat_model = FlatModel(_module(name), "cross-entropy")
    flat = flat_model.initial_params().to(DEVICE)
    if len(x) > 1:  # clients at their own points, as after local steps
        flat = flat.repeat(len(x), 1)

    def step() -> None:
        update, _ = flat_model.clipped_mean(flat, x, y, CLIP)
        flat.add_(update if len(x) > 1 else update[0], alpha=-LR)

    return step


def agreement(name: str, mode: str) -> tuple[float, int]:
    """max |Opacus − dpfl| ÷ max |dpfl| of one client's clipped mean at the initial point, at
    the radius that clips half of its samples (both branches of the clip), and how many were
    clipped. On a GPU in full float32: cuDNN convolutions default to TF32 (10-bit mantissas),
    which would measure the kernels' rounding, not the clipping (the timed steps keep it)."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        return _agreement(name, mode)


def _agreement(name: str, mode: str) -> tuple[float, int]:
    x, y = _data(name, 1)
    flat_model = FlatModel(_module(name), "cross-entropy")
    flat = flat_model.initial_params().to(DEVICE)
    clip = flat_model.clipped_mean(flat, x, y, CLIP)[1].median().item()
    means, norms = flat_model.clipped_mean(flat, x, y, clip)
    ours = means[0]
    model, optimizer, criterion = _opacus(name, mode, x, y, clip)
    optimizer.zero_grad()
    criterion(model(x[0]), y[0]).backward()
    optimizer.pre_step()  # clip, accumulate, noise (0), scale by 1/BATCH: p.grad is the mean
    theirs = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    return ((theirs - ours).abs().max() / ours.abs().max()).item(), int((norms > clip).sum())


def measure(name: str, n_clients: int, repeats: int) -> list[Row]:
    x, y = _data(name, n_clients)
    steps = {"plain": _plain_step(name, x, y), "dpfl": _dpfl_step(name, x, y)}
    steps |= {label: _opacus_step(name, mode, x, y) for label, mode in OPACUS.items()}
    times = interleaved(steps, repeats, warmup=max(1, repeats // 10))
    workload = f"{name}, batch {BATCH}, {n_clients} client{'s' if n_clients > 1 else ''}"
    target = MODELS[name][2]
    rows = [Row.of(SECTION, "plain step (mean-loss backward + SGD)", workload, "",
                   [1e3 * t for t in times["plain"]], "ms")]
    for label in list(steps)[1:]:
        rows.append(Row.of(
            SECTION, f"{label} clipped step ÷ plain step", workload, "",
            ratios(times[label], times["plain"]), "×",
            **({"target": f"≤ {target}×", "limit": target}
               if label == "dpfl" and target is not None else {})))
    return rows


def joint(clients: int, batch: int, repeats: int, own: bool) -> list[Row]:
    """The joint-tape rows (module docstring) for ``clients`` × ``batch`` on the MLP, at one
    point or (``own``) at points of their own."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(clients, batch, *MODELS["mlp"][0], generator=gen).to(DEVICE)
    y = torch.randint(0, 10, (clients, batch), generator=gen).to(DEVICE)
    models = {on: FlatModel(_module("mlp"), "cross-entropy", joint_tapes=on)
              for on in (False, True)}
    flat = models[True].initial_params().to(DEVICE)
    if own:  # a cohort's iterates after a local step: rows of one tensor
        moved = flat + 0.01 * torch.randn(clients, len(flat), generator=gen).to(DEVICE)
        flat = aligned_rows(flat, clients, len(flat)).copy_(moved)
    means = {}

    def call(on: bool) -> Step:
        def step() -> None:
            means[on] = models[on].clipped_mean(flat, x, y, CLIP)
        return step

    times = interleaved({on: call(on) for on in models}, repeats, warmup=1)
    equal = all(torch.equal(a, b) for a, b in zip(means[False], means[True]))
    taken = sum(models[True].tapes.joint.values())
    workload = (f"mlp, {clients:,} clients × batch {batch}, "
                f"{'points of their own' if own else 'one point'} ({taken} of "
                f"{len(models[True].tapes.joint)} layouts joint; results bit for bit "
                f"{'equal' if equal else 'DIFFERENT'})")
    return [
        Row.of(SECTION, "clipped mean a client, a tape per client", workload, "",
               [1e6 * t / clients for t in times[False]], "µs"),
        Row.of(SECTION, "clipped mean a client, joint tapes", workload, "",
               [1e6 * t / clients for t in times[True]], "µs"),
        Row.of(SECTION, "joint tapes ÷ a tape per client", workload, "",
               ratios(times[True], times[False]), "×"),
    ]


def main() -> None:
    global DEVICE
    args = parse(arguments(__doc__.splitlines()[0], device=True))
    DEVICE = torch.device(args.device)
    # Opacus' full backward hooks warn that the inputs need no gradient; they need none here
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    warnings.filterwarnings("ignore", "Secure RNG turned off")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {BATCH}, "
          f"{DEVICE}",
          file=sys.stderr)
    rows: list[Row] = []
    for name, (_, clients, _) in MODELS.items():
        for label, mode in OPACUS.items():
            gap, clipped = agreement(name, mode)
            if gap > AGREEMENT:
                print(f"{name}: {label} and dpfl disagree: {gap:.2e}", file=sys.stderr)
            rows.append(Row.of(
                SECTION, f"{label} vs dpfl clipped mean: largest difference ÷ largest entry",
                f"{name}, batch {BATCH} ({clipped} clipped)", "", [gap], "",
                target=f"≤ {AGREEMENT:g}", limit=AGREEMENT))
        for n_clients in clients:
            repeats = REPEATS[name, n_clients][args.quick]
            rows += measure(name, n_clients, repeats)
            print(f"{name} × {n_clients} done", file=sys.stderr, flush=True)
    for own in (False, True):
        for clients, batch in JOINT:
            rows += joint(clients, batch, 3 if args.quick else 11, own)
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
