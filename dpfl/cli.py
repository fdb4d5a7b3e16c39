"""``dpfl``: the command line.

``dpfl run --run-config "key=value ..."`` runs the in-process engine;
``dpfl flower --run-config ...`` runs the same configuration through ``flwr run``
(Ray simulation, on this machine or, with ``--ray-address``, on a running Ray cluster) and
stops the SuperLink it started; ``dpfl certs FOLDER`` writes the
certificates and node keys of a federation over TLS; ``dpfl export-partition FILE`` writes one
client's records of a run's split as a site's own data file; ``dpfl export-app FOLDER`` writes
the Flower app that ``flwr run`` and ``flwr build`` read (from a checkout or an installed
wheel); ``dpfl audit --run-config ...`` measures an empirical lower bound on a configuration's
ε with canary runs; ``dpfl wait-for superlink|supernodes CONNECTION`` waits, within a bound, for
a federation's SuperLink or SuperNodes to start, and says why one did not. Bad input prints one line naming the key and the allowed values, and exits with
status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from dpfl.config import parse_overrides
from dpfl.errors import ConfigError, NonFiniteError, UsageError, did_you_mean
from dpfl.interrupt import exit_status, sigterm_interrupts


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad option said on one line, like bad run-config input."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dpfl: error: {self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpfl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "run in the in-process engine (all clients batched)"),
                       ("flower", "run through `flwr run` (Ray simulation)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--run-config", "-c", action="append", default=[],
                       help='space-separated key=value pairs, e.g. "clip=0.5 dataset=\\"mnist\\""')
        p.add_argument("--resume", type=Path, metavar="FOLDER",
                       help="continue the run in this results folder from its checkpoint, "
                       "with its config.json (-c may change num-server-rounds, "
                       "checkpoint-every and round-timeout)")
        if name == "flower":
            p.add_argument("--num-supernodes", type=int, default=None,
                           help="virtual SuperNodes (default: num-partitions)")
            p.add_argument("--verbose", "-v", action="store_true",
                           help="show all of Flower's and Ray's output (always kept in "
                           "flower.log in the results folder)")
            p.add_argument("--ray-address", metavar="HOST:PORT",
                           help="run the ClientApps on this running Ray cluster (its head's "
                           "address, as `ray start --head` prints it) instead of a Ray "
                           "started here; run dpfl on one of its nodes")
            p.add_argument("--client-cpus", type=int, metavar="N",
                           help="CPUs Ray reserves per ClientApp actor (Flower's "
                           "client-resources; default 2): a node of C CPUs runs C // N "
                           "clients at once")
            p.add_argument("--client-gpus", type=float, metavar="X",
                           help="share of a GPU per ClientApp actor (default 0), e.g. 0.25 "
                           "for four clients per GPU")
        else:
            p.add_argument("--quiet", "-q", action="store_true",
                           help="no line per round: the results folder and warnings only")
    p = sub.add_parser("reproduce", help="run a paper reproduction on the engine and write "
                       "its report (dpfl reproduce --list shows them)")
    p.add_argument("paper", nargs="?")
    p.add_argument("experiment", nargs="?")
    p.add_argument("--smoke", action="store_true", help="a reduced version (what CI runs)")
    p.add_argument("--results-dir", default="results")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="parallel engine processes (default: CPU cores)")
    p.add_argument("--only", action="append", default=[], metavar="AXIS=V1,V2",
                   help="restrict an axis of the experiment, e.g. --only epsilon=27,5.2 "
                   "--only model=mlp (the runs are shared with the full experiment)")
    p.add_argument("--reuse", action="append", default=[], metavar="ARCHIVE", type=Path,
                   help="a runs.jsonl.gz written beside an earlier report (e.g. in reports/): "
                   "its runs count as finished and are not run again")
    p.add_argument("--plan", action="store_true",
                   help="run and write nothing: say which stage of the experiment has runs "
                   "left to do, how many, and their run time (by the experiment's cost model, "
                   "else at the finished runs' pace)")
    p.add_argument("--list", action="store_true", help="list the experiments")
    p = sub.add_parser("certs", help="generate a CA, a SuperLink certificate and SuperNode "
                       "keys for a federation over TLS with node authentication")
    p.add_argument("folder", type=Path)
    p.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs (default: 2)")
    p.add_argument("--host", action="append", default=[],
                   help="a name or IP address the SuperLink is reached at (repeatable; "
                   "localhost and 127.0.0.1 are always included)")
    p = sub.add_parser("export-partition", help="write one client's records of a run's split "
                       "as a site's own data file (a SuperNode's node config data-path)")
    p.add_argument("file", type=Path, help="the .npz to write (never overwritten)")
    p.add_argument("--run-config", "-c", action="append", default=[],
                   help="the run whose split to take (dataset, partitioner, num-partitions, "
                   "seed, ...)")
    p.add_argument("--partition-id", type=int, required=True, help="the client whose rows")
    p = sub.add_parser("export-app", help="write the Flower app (pyproject.toml, README.md, "
                       "LICENSE, the dpfl sources) to FOLDER, for `flwr run FOLDER` and "
                       "`flwr build --app FOLDER`")
    p.add_argument("folder", type=Path, help="a folder that does not exist yet, or is empty")
    p = sub.add_parser("audit", help="measure an empirical lower bound on a configuration's "
                       "ε (canary runs, Clopper-Pearson confidence) and a Gaussian-DP estimate "
                       "beside the ledger's ε")
    p.add_argument("--run-config", "-c", action="append", default=[],
                   help=f"the configuration to audit; the audit's own defaults: "
                   f"{' '.join(f'{k}={v!r}' for k, v in AUDIT_DEFAULTS.items())}")
    p.add_argument("--trials", type=int, default=1000,
                   help="runs with and runs without the canary (default: 1000 each)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the lower bound (default: 0.95)")
    p.add_argument("--client", type=int, default=0, help="the client whose data is audited")
    p.add_argument("--view", default=None,
                   help="under secure-aggregation, what the audited server sees: 'sum' (every "
                   "exchange's sum, as the protocol gives it; the default) or 'upload' (one "
                   "client's uploads read alone: with distributed-noise, against "
                   "epsilon_if_unmasked)")
    p.add_argument("--one-run", action="store_true",
                   help="audit one real run instead: --canaries gradient canaries, each in with "
                   "probability ½, and --guesses guesses (Steinke et al. 2023)")
    p.add_argument("--canaries", type=int, default=1000,
                   help="the one-run audit's canaries (default: 1000)")
    p.add_argument("--guesses", type=int, default=100,
                   help="the one-run audit's guesses, half 'in', half 'out' (default: 100)")
    p.add_argument("--canary", default="gradient",
                   help="a gradient canary (default: the model gains a coordinate only the "
                   "canary moves, the tightest) or an input canary (a crafted record, as a "
                   "client's data could hold it)")
    p = sub.add_parser("check-node", help="check, before starting a SuperNode, that its "
                       "environment and its node config can serve dpfl runs")
    p.add_argument("--node-config", default="",
                   help="the SuperNode's --node-config text, e.g. 'partition-ids=\"0\"'")
    p = sub.add_parser("wait-for", help="wait, within --timeout, until the SuperLink behind "
                       "a flwr connection answers, or --count SuperNodes are online there; a "
                       "watched process that exits ends the wait with why (from its log)")
    p.add_argument("what", choices=("superlink", "supernodes"))
    p.add_argument("connection", help="the SuperLink connection's name (as for flwr)")
    p.add_argument("--count", type=int, default=None,
                   help="SuperNodes to wait for (default: as many as --pid)")
    p.add_argument("--pid", type=int, action="append", default=[],
                   help="a process to watch (repeatable; each with its --log, in order)")
    p.add_argument("--log", type=Path, action="append", default=[],
                   help="the file the process of the --pid at the same place logs to")
    p.add_argument("--timeout", type=float, default=60, help="seconds (default: 60)")
    p = sub.add_parser("keys", help="list the run-config keys: default, paper symbol, meaning")
    p.add_argument("algorithm", nargs="?", help="also list this algorithm's own keys and its "
                   "calibrations' (default: every algorithm's key names)")
    return parser


def keys(args: argparse.Namespace) -> int:
    """``dpfl keys [ALGORITHM]``: the keys every run reads, then the algorithm's own (or, with
    no algorithm, the names of each algorithm's own keys)."""
    import shutil
    import textwrap

    from dpfl.algorithms.tuned import tuned_value
    from dpfl.config import AUTO, COMMON, Param, format_overrides, params_of
    from dpfl.privacy.calibration import CALIBRATIONS
    from dpfl.runconfig import ALGORITHMS, DATASETS, MODELS, PARTITIONERS, algorithm_default

    epsilon = float(next(q.default for q in COMMON if q.key == "epsilon"))  # "auto" shown there

    algorithm = None if args.algorithm is None else ALGORITHMS.get(args.algorithm)
    registries = {"algorithm": ALGORITHMS, "dataset": DATASETS, "model": MODELS,
                  "partitioner": PARTITIONERS}
    width = min(shutil.get_terminal_size().columns, 100)

    def show(title: str, params: tuple[Param, ...]) -> None:
        print(f"{title}:")
        for p in params:
            if algorithm is not None and p.per_algorithm:  # what "auto" gives this algorithm
                value = algorithm_default(algorithm, p, epsilon)
                mine = (f": follows ε, here ε = {epsilon:g}, MNIST IID's point (a benchmarked "
                        f"setting's own: docs/benchmark.md)"
                        if tuned_value(algorithm.name, p.key, epsilon) is not None
                        else f": {algorithm.name}'s own" if p.key in algorithm.defaults else "")
                head = f"  {format_overrides({p.key: value})}  [{AUTO}{mine}]"
            else:
                head = f"  {format_overrides({p.key: p.config_default})}"
            if p.symbol:
                head += f"  ({p.symbol})"
            choices = p.choices or (registries[p.key].names() if p.key in registries else None)
            text = p.help + (f" Allowed: {', '.join(choices)}." if choices else "")
            print(head)
            print(textwrap.fill(text, width, initial_indent="      ",
                                subsequent_indent="      "))

    show("Keys every run reads", COMMON)
    if algorithm is None:
        print("\nEach algorithm's own keys (dpfl keys ALGORITHM explains them):")
        for name in ALGORITHMS.names():
            own = ", ".join(p.key for p in params_of(ALGORITHMS.get(name).Hyperparameters))
            print(textwrap.fill(f"{name}: {own or 'none'}", width, initial_indent="  ",
                                subsequent_indent="      "))
        return 0
    print()
    show(f"Keys of algorithm {algorithm.name}", params_of(algorithm.Hyperparameters))
    refusal = algorithm.secure_aggregation_refusal(None)  # the declaration reads no key
    print("\n" + textwrap.fill(
        "secure-aggregation and distributed-noise: "
        + ("accepted" if refusal is None else f"refused: {refusal}"), width))
    for name in CALIBRATIONS.offered(algorithm.name):
        options = CALIBRATIONS.get(name, algorithm.name).options
        if options is not None:
            print()
            show(f'Keys of calibration="{name}"', params_of(options))
    return 0


def wait_for(args: argparse.Namespace) -> int:
    """``dpfl wait-for superlink|supernodes CONNECTION``: one line when it is up; one line
    saying what failed, and status 1, when a watched process exits or time runs out."""
    from dpfl.started import StartFailed, Watched
    from dpfl.started import wait_for as wait

    if len(args.pid) != len(args.log):
        raise UsageError(f"--pid and --log: {len(args.pid)} and {len(args.log)} given "
                         f"(allowed: one --log for each --pid)")
    count = len(args.pid) if args.count is None else args.count
    if args.what == "supernodes" and count < 1:
        raise UsageError("--count: the SuperNodes to wait for (allowed: 1 or more, or a --pid "
                         "for each)")
    role = "the SuperLink" if args.what == "superlink" else "the SuperNode"
    watched = [Watched(role, pid, log) for pid, log in zip(args.pid, args.log)]
    try:
        print(wait(args.what, args.connection, watched, count=count, timeout=args.timeout),
              flush=True)
    except StartFailed as failed:
        print(f"dpfl: error: {failed}", file=sys.stderr)
        return 1
    return 0


def export_partition(args: argparse.Namespace) -> int:
    from dpfl.datasets.site import write_site_data
    from dpfl.problem import build_problem
    from dpfl.runconfig import RunConfig

    problem = build_problem(RunConfig(parse_overrides(args.run_config)))
    if not 0 <= args.partition_id < problem.num_clients:
        raise UsageError(f"--partition-id: {args.partition_id} (allowed: 0.."
                         f"{problem.num_clients - 1})")
    data = problem.node_data([args.partition_id])
    write_site_data(args.file, dataset=data["name"], task=data["task"],
                    num_classes=data["num_classes"], x=data["train_x"], y=data["train_y"])
    print(f"wrote {args.file}: {data['sizes'][0]} {data['name']} records of client "
          f"{args.partition_id} of {problem.num_clients}")
    return 0


def export_app(args: argparse.Namespace) -> int:
    from dpfl.flower_app import write_app

    try:
        folder = write_app(args.folder)
    except (FileExistsError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote the Flower app to {folder}: flwr run {folder} --stream")
    return 0


def certs(args: argparse.Namespace) -> int:
    from dpfl.certs import generate

    written = generate(args.folder, args.nodes, args.host)
    print(f"wrote {len(written)} files to {args.folder}: "
          + " ".join(p.name for p in written))
    return 0


#: what ``dpfl audit`` changes from a run's defaults, unless given: a small model, few rounds
AUDIT_DEFAULTS: dict[str, object] = {"model": "logistic", "num-server-rounds": 5}


def audit(args: argparse.Namespace) -> int:
    """``dpfl audit``: the canary audit of a configuration, written to its results folder."""
    from dpfl.audit import CANARIES, VIEWS
    from dpfl.audit import audit as run_audit
    from dpfl.audit.report import verdict, write
    from dpfl.results import results_path
    from dpfl.runconfig import RunConfig

    if args.trials < 4:
        raise UsageError(f"--trials: {args.trials} (allowed: an integer of at least 4)")
    if not 0 < args.confidence < 1:
        raise UsageError(f"--confidence: {args.confidence} (allowed: strictly between 0 and 1)")
    if args.canary not in CANARIES:
        raise UsageError(f"--canary: {args.canary!r} (allowed: {', '.join(CANARIES)})")
    given = parse_overrides(args.run_config) if args.run_config else {}
    config = RunConfig({**AUDIT_DEFAULTS, **given})
    if args.view is not None and (args.view not in VIEWS or not config.secure.secure_aggregation):
        raise UsageError(f"--view: {args.view!r} (allowed: {', '.join(VIEWS)}, with "
                         f"secure-aggregation=true)")
    if not 0 <= args.client < config.data.num_partitions:
        raise UsageError(f"--client: {args.client} (allowed: 0.."
                         f"{config.data.num_partitions - 1})")
    if args.one_run:
        return audit_one_run(args, config)
    result = run_audit(config, trials=args.trials, confidence=args.confidence,
                       client=args.client, canary=args.canary, view=args.view)
    folder = write(result, config, results_path(config, "audit"))
    print(verdict(result))
    print(f"audit of {2 * args.trials} runs in {result.seconds:.1f} s; results in {folder}")
    return 0


def audit_one_run(args: argparse.Namespace, config) -> int:
    """``dpfl audit --one-run``: the one-run audit of ``config``, written to its results
    folder."""
    from dpfl.audit.one_run import one_run
    from dpfl.audit.report import write_one_run
    from dpfl.results import results_path

    if not 2 <= args.guesses <= args.canaries:
        raise UsageError(f"--guesses: {args.guesses} (allowed: 2..--canaries, "
                         f"{args.canaries})")
    result = one_run(config, canaries=args.canaries, guesses=args.guesses,
                     confidence=args.confidence, client=args.client)
    folder, line = write_one_run(result, config, results_path(config, "audit"))
    print(line)
    print(f"one-run audit in {result.seconds:.1f} s; results in {folder}")
    return 0


def reproduce(args: argparse.Namespace) -> int:
    try:
        from dpfl_reproductions import EXPERIMENTS, Lab
        from dpfl_reproductions.lab import Pending
    except ModuleNotFoundError as missing:
        if missing.name != "dpfl_reproductions":
            raise
        raise UsageError("reproduce: the reproductions (package dpfl_reproductions) are not "
                         "installed beside dpfl (allowed: an install of dpfl's wheel or of "
                         "its checkout, which ship them)") from None

    if args.list or not args.paper:
        for key in EXPERIMENTS.names():
            print(f"{key:28s} {EXPERIMENTS.get(key).summary}")
        return 0
    name = args.paper if args.experiment is None else f"{args.paper}/{args.experiment}"
    if name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {name!r}{did_you_mean(name, EXPERIMENTS)} "
                         f"(allowed: {', '.join(EXPERIMENTS.names())}, as PAPER/EXPERIMENT "
                         f"or PAPER EXPERIMENT)")
    exp = EXPERIMENTS.get(name)
    only: dict[str, list[str]] = {}
    for option in args.only:
        axis, sep, values = option.partition("=")
        if not sep or axis not in exp.axes or not values:
            allowed = ", ".join(f"{a}=..." for a in exp.axes) or "none for this experiment"
            raise UsageError(f"--only {option!r}: expected AXIS=V1,V2 with AXIS one of the "
                             f"experiment's axes (allowed: {allowed})")
        only[axis] = [v.strip() for v in values.split(",") if v.strip()]
    suffix = "-smoke" if args.smoke else ""
    lab = Lab(Path(args.results_dir) / f"reproduce-{exp.paper}-{exp.name}{suffix}",
              smoke=args.smoke, workers=args.workers, only=only, reuse=args.reuse,
              plan=args.plan)
    try:
        title = exp.run(lab)
    except Pending as pending:
        print(f"plan of {name} in {lab.folder} (nothing run or written):\n{pending.describe()}")
        return 0
    if args.plan:
        print(f"plan of {name} in {lab.folder} (nothing run or written): every run of its "
              f"{lab.stages} stages is finished; without --plan the report is written from "
              f"them")
        return 0
    print(f"report: {lab.write(title)}")
    return 0


def resume(folder: Path, overrides: dict, command: str) -> dict:
    """``--resume FOLDER``: the run config that continues the run in ``folder``, checked
    against its checkpoint before anything starts."""
    from dpfl.checkpoint import load, resume_overrides
    from dpfl.runconfig import RunConfig

    values = resume_overrides(folder, overrides)
    load(RunConfig(values), "engine" if command == "run" else "flower")
    return values


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with sigterm_interrupts():
        return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run the command ``args`` name; bad input, a run stopped on a non-finite value and an
    interruption (Ctrl-C, SIGTERM) end it with one line and the exit status they call for."""
    try:
        if args.command == "reproduce":
            return reproduce(args)
        if args.command == "certs":
            return certs(args)
        if args.command == "export-partition":
            return export_partition(args)
        if args.command == "keys":
            return keys(args)
        if args.command == "check-node":
            from dpfl.client.preflight import check_node

            for line in check_node(args.node_config):
                print(line)
            return 0
        if args.command == "audit":
            return audit(args)
        if args.command == "export-app":
            return export_app(args)
        if args.command == "wait-for":
            return wait_for(args)
        overrides = parse_overrides(args.run_config) if args.run_config else {}
        if args.resume is not None:
            overrides = resume(args.resume, overrides, args.command)
        if args.command == "run":
            from dpfl.engine import run
            from dpfl.runconfig import RunConfig

            summary = run(RunConfig(overrides), echo=not args.quiet)
            if args.quiet:
                print(f"results in {summary['results']}")
            return 0
        from dpfl.launch import flwr_run

        return flwr_run(overrides, num_supernodes=args.num_supernodes, verbose=args.verbose,
                        ray_address=args.ray_address, client_cpus=args.client_cpus,
                        client_gpus=args.client_gpus)
    except (ConfigError, UsageError) as exc:
        print(f"dpfl: error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:  # the run stopped; its results folder says so too
        print(f"dpfl: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM (dpfl.interrupt): the run
        # closed its results folder (and said where), and stopped what it started
        print("dpfl: interrupted", file=sys.stderr)
        return exit_status(interrupt)


if __name__ == "__main__":
    sys.exit(main())
