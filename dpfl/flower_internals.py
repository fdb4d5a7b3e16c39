"""Every name dpfl takes from Flower's internals, in one place.

dpfl builds on Flower's documented API where it can (``flwr.app``, ``flwr.serverapp``,
``flwr.clientapp``, ``flwr.server.workflow.SecAggPlusWorkflow``, ``flwr.server.LegacyContext``,
``flwr.client.mod.secaggplus_mod``, the legacy ``flwr.common`` records), imported where they are
used. What it needs beyond that — the SecAgg+ workflow's stages and state, which dpfl drives one
exchange at a time; the constants of the SecAgg+ messages a node inspects; Flower's config
parser; the conversion of a legacy ``FitRes`` into the reply SecAgg+'s mod expects; its exit
handlers and exit codes; its simulation defaults — comes from here, so that a
Flower upgrade that moves or changes one of them fails in this module, by name, and in
``tests/test_flower_internals.py``, which checks the contract dpfl relies on for each.
Checked against Flower 1.42.0.

:mod:`dpfl.flower_secagg` replaces the mask generator named by :data:`SECAGG_MASK_CALLERS`; the
ServerApp (:mod:`dpfl.server.app`) counts on Flower's parent monitor raising SIGINT in a thread
of its own (``tests/test_serverapp_exit.py``).
"""

from __future__ import annotations

from flwr.common.config import parse_config_args
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG
from flwr.supercore.exit import add_exit_handler
from flwr.supercore.exit.exit_code import EXIT_CODE_HELP

#: the modules of Flower's SecAgg+ that import its mask generator, ``pseudo_rand_gen``, by name
SECAGG_MASK_CALLERS = ("flwr.client.mod.secure_aggregation.secaggplus_mod",
                       "flwr.server.workflow.secure_aggregation.secaggplus_workflow")
#: the stages of ``SecAggPlusWorkflow`` dpfl calls one by one, each ``(grid, context, state)``
SECAGG_STAGES = ("setup_stage", "share_keys_stage", "collect_masked_vectors_stage",
                 "unmask_stage")

__all__ = ["DEFAULT_SIMULATION_CONFIG", "EXIT_CODE_HELP", "GridClientProxy",
           "MAIN_CONFIGS_RECORD", "MAIN_PARAMS_RECORD", "RECORD_KEY_CONFIGS",
           "SECAGG_MASK_CALLERS", "SECAGG_STAGES", "SecAggKey", "Stage", "WorkflowKey",
           "WorkflowState", "add_exit_handler", "fitres_to_recorddict", "parse_config_args"]
