"""The contract dpfl relies on for each name it takes from Flower's internals
(:mod:`dpfl.flower_internals`): a Flower upgrade that breaks one fails here, by name."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import flwr
import pytest
from flwr.server.workflow import SecAggPlusWorkflow

from dpfl import flower_internals as internals


def test_flower_is_the_version_the_adapter_was_checked_against():
    assert flwr.__version__ == "1.42.0", ("dpfl.flower_internals was checked against Flower "
                                          "1.42.0: check each name below, then this line")


def test_the_config_parser_reads_flowers_key_value_syntax():
    assert dict(internals.parse_config_args(['a=1 b="x" c=0.5 d=true'])) == {
        "a": 1, "b": "x", "c": 0.5, "d": True}


def test_the_secagg_message_constants_name_the_stages_a_node_inspects():
    assert isinstance(internals.RECORD_KEY_CONFIGS, str)
    assert {"setup", "share_keys", "collect_masked_vectors", "unmask"} <= {
        str(s) for s in vars(internals.Stage).values() if isinstance(s, str)}
    assert isinstance(internals.SecAggKey.STAGE, str)
    assert isinstance(internals.SecAggKey.ACTIVE_NODE_ID_LIST, str)


def test_the_workflow_state_and_main_records_dpfl_fills_for_each_exchange():
    state = internals.WorkflowState()
    assert {"active_node_ids", "nid_to_fitins"} <= {f.name for f in dataclasses.fields(state)}
    assert isinstance(internals.MAIN_CONFIGS_RECORD, str)
    assert isinstance(internals.MAIN_PARAMS_RECORD, str)
    assert isinstance(internals.WorkflowKey.CURRENT_ROUND, str)


@pytest.mark.parametrize("stage", internals.SECAGG_STAGES)
def test_each_secagg_stage_takes_grid_context_and_state(stage):
    method = getattr(SecAggPlusWorkflow, stage)
    assert list(inspect.signature(method).parameters) == ["self", "grid", "context", "state"]


def test_a_legacy_fit_result_becomes_the_reply_secaggs_mod_reads():
    import numpy as np
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    content = internals.fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
        [np.arange(3)]), num_examples=1, metrics={}), keep_input=True)
    assert [a.numpy().tolist() for a in content.array_records["fitres.parameters"].values()
            ] == [[0, 1, 2]]


def test_the_grid_client_proxy_wraps_a_node_of_a_grid():
    assert list(inspect.signature(internals.GridClientProxy).parameters)[:3] == [
        "node_id", "grid", "run_id"]


@pytest.mark.parametrize("caller", internals.SECAGG_MASK_CALLERS)
def test_secaggs_mask_generator_is_imported_by_name_where_dpfl_replaces_it(caller):
    assert callable(importlib.import_module(caller).pseudo_rand_gen)


def test_the_simulation_defaults_give_each_clientapp_its_resources():
    config = internals.DEFAULT_SIMULATION_CONFIG
    assert float(config.client_resources_num_cpus) > 0
    assert float(config.client_resources_num_gpus) >= 0


def test_an_exit_handler_can_run_before_flowers_kill_clock():
    assert "run_before_force_exit" in inspect.signature(internals.add_exit_handler).parameters


def test_flowers_exit_codes_have_help_texts():
    assert internals.EXIT_CODE_HELP and all(
        isinstance(c, int) and isinstance(t, str) for c, t in internals.EXIT_CODE_HELP.items())


def test_nothing_else_in_dpfl_imports_flower_internals():
    """Flower's documented modules only, outside the adapter."""
    import re
    from pathlib import Path

    documented = re.compile(r"^flwr(\.app|\.serverapp|\.clientapp|\.clientapp\.typing|\.compat"
                            r"|\.client|\.client\.mod|\.common|\.server|\.server\.strategy"
                            r"|\.server\.workflow|\.serverapp\.strategy)?$")
    root = Path(internals.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.name == "flower_internals.py":
            continue
        for line in path.read_text().splitlines():
            if m := re.match(r"\s*(?:from (flwr(?:\.\w+)*) import|import (flwr(?:\.\w+)*)\b)",
                             line):
                module = m.group(1) or m.group(2)
                if not documented.match(module):
                    found.append(f"{path.relative_to(root)}: {module}")
    assert found == []

