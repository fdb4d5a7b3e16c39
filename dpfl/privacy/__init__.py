"""Privacy core: releases, calibration, noise, clipping, keyed randomness and the ledger."""

from dpfl.privacy.calibration import (
    CALIBRATIONS,
    Target,
    accountant_noise_multiplier,
    calibrate,
)
from dpfl.privacy.clipping import (
    CLIPPING_FUNCTIONS,
    ClippingFunction,
    clip_by_norm,
    clip_factors,
)
from dpfl.privacy.ledger import Accounting, PrivacyLedger
from dpfl.privacy.noise import add_noise
from dpfl.privacy.randomness import SERVER, Randomness
from dpfl.privacy.release import Query, Relation, Release, Side, stds

__all__ = [
    "CALIBRATIONS",
    "CLIPPING_FUNCTIONS",
    "SERVER",
    "Accounting",
    "ClippingFunction",
    "PrivacyLedger",
    "Query",
    "Randomness",
    "Relation",
    "Release",
    "Side",
    "Target",
    "accountant_noise_multiplier",
    "add_noise",
    "calibrate",
    "clip_by_norm",
    "clip_factors",
    "stds",
]
