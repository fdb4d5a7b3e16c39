"""``dpfl check-node``: what a SuperNode needs to serve dpfl runs, checked before it starts.

A SuperNode runs each ClientApp through ``flower-superexec``, which it looks up on ``PATH``.
Started from an environment where that program is missing (the one dpfl is installed in, not
activated), it logs a ``FileNotFoundError`` and stays registered with the SuperLink without ever
serving a run: a silent hang. This check says so in one line before the node starts, and checks
the rest of what the node brings: its node config (Flower's syntax, the clients it hosts, its
privacy policy, :mod:`dpfl.client.policy`), its state folder (where its ledgers must be
written), its noise key and its own data file.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict

from dpfl.client.numpy_client import node_clients
from dpfl.client.policy import NodeConfigError, NodePolicy
from dpfl.errors import UsageError
from dpfl.runconfig import RunConfig

PROGRAMS = ("flower-supernode", "flower-superexec")


def check_node(text: str) -> list[str]:
    """The lines of a node's check, one per thing checked; raises :class:`UsageError` or
    :class:`~dpfl.client.policy.NodeConfigError` (one line) on the first that fails."""
    from dpfl.flower_internals import parse_config_args

    lines = []
    here = Path(sys.executable).parent
    for program in PROGRAMS:
        found = shutil.which(program)
        if found is None:
            raise UsageError(f"{program} is not on PATH, so a SuperNode would never serve a "
                             f"run: activate the environment dpfl is installed in (source "
                             f"{here}/activate) or put {here} on PATH")
        other = "" if Path(found).parent == here else (
            f" (not beside this Python, {here}: the ClientApps would run in another "
            f"environment, which must have dpfl)")
        lines.append(f"ok  {program}: {found}{other}")
    try:
        node_config = dict(parse_config_args([text])) if text.strip() else {}
    except Exception as exc:  # Flower's TOML errors: say it in one line
        raise UsageError(f"--node-config: cannot read {text!r} ({exc})") from None
    policy = NodePolicy.of(node_config, RunConfig({}))
    context = Context(run_id=0, node_id=0, node_config=node_config, state=RecordDict(),
                      run_config={})
    if not any(k in node_config for k in ("partition-ids", "partition-id")):
        raise NodeConfigError("partition-ids", "the node hosts no client",
                              allowed='the clients it hosts, e.g. partition-ids="0" or "0,3"')
    cap = ("no ε cap" if math.isinf(policy.max_epsilon) else
           f"ε at most {policy.max_epsilon:g} at δ={policy.delta:g} ({policy.accountant}) over "
           f"every run it serves")
    lines.append(f"ok  node config: clients {node_clients(context)}; noise {policy.noise}; "
                 f"{cap}; diagnostics {'allowed' if policy.diagnostics else 'refused'}; "
                 f"{len(policy.algorithms)} algorithms, relations "
                 f"{', '.join(sorted(policy.relations))}"
                 + ("; it trusts the server (follows the run config)" if policy.trust_server
                    else ""))
    folder = policy.state_dir
    try:
        (folder / "ledger").mkdir(parents=True, exist_ok=True)
        (folder / "ledger" / ".writable").touch()
    except OSError as error:
        raise NodeConfigError("state-dir", f"{str(folder)!r} cannot be written "
                              f"({error.strerror}): the node keeps its privacy ledger there",
                              allowed="a folder this user can write") from None
    lines.append(f"ok  state folder {folder}: writable (ledgers, state files, noise key)")
    if policy.noise == "keyed":
        policy.secret()
        lines.append(f"ok  noise key {policy.noise_key}")
    if site := str(node_config.get("data-path", "")):
        if not Path(site).is_file():
            raise NodeConfigError("data-path", f"{site!r} is not a file",
                                  allowed="the site's .npz data file")
        try:
            with np.load(site, allow_pickle=False) as archive:
                records = len(archive["y"])
        except (OSError, ValueError, KeyError) as error:
            raise NodeConfigError("data-path", f"cannot read {site!r} ({error})",
                                  allowed="the site's .npz data file") from None
        bound = policy.min_client_records
        if bound is not None and bound > records:  # said here, to the operator only
            raise NodeConfigError("min-client-records", f"{bound} exceeds the {records} "
                                  f"records of {site!r}: the node would refuse every run",
                                  allowed=f"1..{records}")
        lines.append(f"ok  data file {site}: {records} records"
                     + (f", min-client-records={bound}" if bound is not None else ""))
    lines.append("this node can serve dpfl runs")
    return lines
