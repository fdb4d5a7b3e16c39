"""The ``accountant`` registry: the ledger's accountants by name, as docs/privacy.md lists them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpfl.errors import ConfigError
from dpfl.privacy.accountants import ACCOUNTANTS
from dpfl.privacy.ledger import PrivacyLedger

DOC = Path(__file__).parents[1] / "docs" / "privacy.md"


def test_the_registry_holds_exactly_the_accountants_the_docs_list():
    listed = re.search(r"The ledger's accountants: ((?:`[^`]+`,?\s*)+)\(", DOC.read_text())
    assert listed is not None
    assert ACCOUNTANTS.names() == sorted(re.findall(r"`([^`]+)`", listed.group(1)))


def test_an_unknown_accountant_fails_naming_the_registered_ones():
    ledger = PrivacyLedger(accountant="gdp", relation="add-remove", history=[(1.0, 0.1, 3)])
    with pytest.raises(ConfigError, match="unknown value 'gdp'") as error:
        ledger.epsilon(1e-5)
    assert error.value.key == "accountant"
    assert error.value.allowed == ", ".join(ACCOUNTANTS.names())
    assert "\n" not in str(error.value)
