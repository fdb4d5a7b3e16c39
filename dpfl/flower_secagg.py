"""SecAgg+ masks expanded from the whole agreed secret: dpfl's replacement for the mask
generator of Flower's SecAgg+, and the one place where dpfl reaches into Flower for it.

Flower's SecAgg+ (1.41, and 1.42 unchanged) expands every mask, a node's private mask from its
32-byte seed and each pairwise mask from the key two nodes agree on, with
``flwr.common.secure_aggregation.secaggplus_utils.pseudo_rand_gen``: it XORs the seed's 4-byte
words into one 32-bit integer and seeds NumPy's MT19937 with it, so every mask is one of 2^32
whatever the secret. After the unmasking the server holds each surviving node's private seed;
with two nodes the one pairwise mask left in a node's masked vector is found by trying the 2^32
folded seeds against the vector's first coordinate (the weight factor: dpfl's is one), which reveals
the node's sum; with three, a meet-in-the-middle search of about 2^32 (docs/privacy.md, "Mask
expansion").

:func:`expand_mask` keeps the generator's contract (a list of int64 arrays of the given shapes,
values below the modulus) and draws from the whole seed: the ChaCha20 keystream (RFC 8439, from
the ``cryptography`` package: :func:`dpfl.privacy.randomness.keystream`) under HKDF-SHA256 of
the seed (RFC 5869), read as little-endian 32-bit words reduced modulo the modulus, a power of
two of at most 2^32 (Flower's workflow admits no other), so each value of [0, modulus) has
probability exactly 1/modulus. Flower's own draw is ``randint(0, modulus − 1)``, which never
gives modulus − 1; the masks only have to cancel modulo the modulus (the node and the server
reduce modulo it after adding and subtracting them), so the full range is as correct, and it
makes each masked coordinate exactly uniform.

:func:`install_mask_expansion` puts it in place of the name each of Flower's two callers
imported: the node's ``secaggplus_mod`` and the server's ``SecAggPlusWorkflow``. A node masks
with it whatever the server runs: a server still expanding with Flower's generator subtracts
other masks and unmasks a wrong sum, it never weakens a node. The protocol (key agreement,
secret sharing, unmasking) stays Flower's.
"""

from __future__ import annotations

import importlib
import inspect
import math
from itertools import accumulate

import flwr
import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfl.flower_internals import SECAGG_MASK_CALLERS
from dpfl.privacy.randomness import keystream

#: the modules of Flower's SecAgg+ that import the mask generator by this name
CALLERS = SECAGG_MASK_CALLERS
NAME = "pseudo_rand_gen"
PARAMETERS = ["seed", "num_range", "dimensions_list"]
#: HKDF's context: these keys expand SecAgg+ masks and nothing else
INFO = b"dpfl secagg+ mask expansion v1"
#: the shortest seed accepted: Flower's private seeds are 32 bytes, its pairwise keys 44
SEED_BYTES = 32


def expand_mask(seed: bytes, num_range: int,
                dimensions_list: list[tuple[int, ...]]) -> list[np.ndarray]:
    """The mask of ``seed``: one int64 array a shape of ``dimensions_list``, each value uniform
    on [0, ``num_range``), drawn in order from ChaCha20's keystream under HKDF-SHA256(seed)."""
    if len(seed) < SEED_BYTES:
        raise ValueError(f"SecAgg+ mask seed of {len(seed)} bytes, under {SEED_BYTES}")
    if not 2 <= num_range <= 2**32 or num_range & (num_range - 1):
        raise ValueError(f"SecAgg+ modulus {num_range} is not a power of two in [2, 2^32]")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(seed)
    sizes = [math.prod(shape) for shape in dimensions_list]
    stream = keystream(key)(4 * sum(sizes))
    words = np.frombuffer(stream, dtype="<u4").astype(np.int64)
    words &= num_range - 1  # modulo a power of two: exactly uniform
    ends = list(accumulate(sizes))
    return [words[end - size:end].reshape(shape)
            for size, end, shape in zip(sizes, ends, dimensions_list, strict=True)]


def install_mask_expansion() -> None:
    """Make Flower's SecAgg+ mod and workflow expand masks with :func:`expand_mask`; raises
    RuntimeError, naming the Flower internal, where this Flower lacks the generator dpfl
    replaces (a Flower upgrade fails here, not in a weaker mask)."""
    for caller in CALLERS:
        module = importlib.import_module(caller)
        found = getattr(module, NAME, None)
        if found is expand_mask:
            continue
        if not callable(found) or list(inspect.signature(found).parameters) != PARAMETERS:
            raise RuntimeError(f"dpfl replaces {caller}.{NAME}({', '.join(PARAMETERS)}), "
                               f"Flower's SecAgg+ mask expansion, which Flower "
                               f"{flwr.__version__} does not have: dpfl's secure aggregation "
                               f"needs updating for this Flower")
        setattr(module, NAME, expand_mask)
