"""Privacy core: clipping, keyed randomness, calibration, and the ledger."""

from dpfl.privacy.calibration import (
    PrismaCalibration,
    accountant_noise_multiplier,
    clip21_paper_noise_std,
    clip21_practice_noise_std,
    prisma_paper_calibration,
)
from dpfl.privacy.clipping import clip_by_norm, clip_factors
from dpfl.privacy.ledger import PrivacyLedger
from dpfl.privacy.randomness import SERVER, Randomness

__all__ = [
    "SERVER",
    "PrismaCalibration",
    "PrivacyLedger",
    "Randomness",
    "accountant_noise_multiplier",
    "clip21_paper_noise_std",
    "clip21_practice_noise_std",
    "clip_by_norm",
    "clip_factors",
    "prisma_paper_calibration",
]
