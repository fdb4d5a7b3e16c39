"""SecAgg+ masks (dpfl.flower_secagg): the search that finds a mask Flower 1.41 expands from a
32-bit fold of its seed, and finds nothing against dpfl's expansion; dpfl's expansion keeps
Flower's contract and draws from every byte of the seed; it is what Flower's mod and workflow
call once dpfl's node and server are imported; a server still on Flower's expansion unmasks a
wrong sum."""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

import dpfl.client.app  # noqa: F401 - installs dpfl's expansion (node side)
import dpfl.strategies.secure  # noqa: F401 - installs it (server side)
from dpfl.engine import run
from dpfl.flower_secagg import CALLERS, expand_mask, install_mask_expansion
from dpfl.runconfig import RunConfig
from tests.inprocess_grid import run_flower_code_path

MODULUS = 2**32
#: the weight factor Flower's mod puts first in a node's vector (dpfl's: one, known)
FACTOR = 1
#: the range of the upload's integers (a quantised sum)
UPLOAD = 2**20
#: the folded seeds the search tries: the crafted pairwise seed folds below this
SPACE = 2**16
DIMENSIONS = [(1,), (16,)]


def fold(seed: bytes) -> int:
    """Flower's fold of a seed to the 32-bit seed of its generator: XOR of 4-byte words."""
    return int(np.bitwise_xor.reduce(np.frombuffer(seed, dtype="<u4")))


def crafted(rng: np.random.Generator, folded: int) -> bytes:
    """A random-looking 32-byte seed whose fold is ``folded``."""
    head = rng.bytes(28)
    return head + (fold(head) ^ folded).to_bytes(4, "little")


def masked(expand, upload: np.ndarray, private: bytes, pairwise: bytes) -> list[np.ndarray]:
    """Node 1's vector in a two-node SecAgg+ exchange, as Flower's mod masks it: the factor and
    the upload, plus its private mask, minus the pairwise mask (node 1 < node 2), modulo 2^32."""
    vector = [np.array([FACTOR]), upload]
    for mask, sign in ((expand(private, MODULUS, DIMENSIONS), 1),
                       (expand(pairwise, MODULUS, DIMENSIONS), -1)):
        vector = [v + sign * m for v, m in zip(vector, mask, strict=True)]
    return [v % MODULUS for v in vector]


def search(vector: list[np.ndarray], private_mask: list[np.ndarray]) -> list[int]:
    """The server's search after the unmasking, which gave it node 1's private seed: the folded
    seeds s < :data:`SPACE` whose first output under Flower's generator (MT19937 seeded by s)
    turns the vector's first coordinate back into the known factor."""
    target = (vector[0][0] - private_mask[0][0]) % MODULUS
    generator = np.random.RandomState()
    found = []
    for folded in range(SPACE):
        generator.seed(folded)
        if (target + generator.randint(0, MODULUS - 1, (1,), dtype=np.int64)[0]) % MODULUS \
                == FACTOR:
            found.append(folded)
    return found


def unmasked(vector: list[np.ndarray], private_mask: list[np.ndarray],
             pairwise_mask: list[np.ndarray]) -> np.ndarray:
    """Node 1's upload from its vector and both masks."""
    return (vector[1] - private_mask[1] + pairwise_mask[1]) % MODULUS


def test_flowers_expansion_gives_the_upload_to_a_search_of_the_folded_seeds():
    """Two nodes: the one pairwise seed left is found among the folded seeds from the first
    coordinate alone, and Flower's own generator, given it, removes the mask: the upload."""
    rng = np.random.default_rng(76)
    upload = rng.integers(0, UPLOAD, 16)
    private, pairwise = rng.bytes(32), crafted(rng, 40_503)
    vector = masked(pseudo_rand_gen, upload, private, pairwise)
    private_mask = pseudo_rand_gen(private, MODULUS, DIMENSIONS)
    assert search(vector, private_mask) == [40_503]
    guess = pseudo_rand_gen((40_503).to_bytes(4, "little"), MODULUS, DIMENSIONS)
    assert np.array_equal(unmasked(vector, private_mask, guess), upload)


def test_dpfls_expansion_gives_the_search_nothing():
    """The same exchange masked with dpfl's expansion: no folded seed reproduces the mask, and
    Flower's generator at the seed's own fold does not remove it."""
    rng = np.random.default_rng(76)
    upload = rng.integers(0, UPLOAD, 16)
    private, pairwise = rng.bytes(32), crafted(rng, 40_503)
    vector = masked(expand_mask, upload, private, pairwise)
    private_mask = expand_mask(private, MODULUS, DIMENSIONS)
    assert search(vector, private_mask) == []
    guess = pseudo_rand_gen((40_503).to_bytes(4, "little"), MODULUS, DIMENSIONS)
    assert not np.array_equal(unmasked(vector, private_mask, guess), upload)
    assert np.array_equal(unmasked(vector, private_mask,
                                   expand_mask(pairwise, MODULUS, DIMENSIONS)), upload)


def test_the_mask_depends_on_every_byte_of_the_seed():
    """Deterministic in the seed; one bit flipped in any of the 32 bytes, or another seed of the
    same fold (the same mask under Flower's), gives another mask."""
    seed = np.random.default_rng(1).bytes(32)
    mask = expand_mask(seed, MODULUS, DIMENSIONS)
    assert all(np.array_equal(a, b) for a, b in
               zip(mask, expand_mask(seed, MODULUS, DIMENSIONS), strict=True))
    for i in range(32):
        flipped = seed[:i] + bytes([seed[i] ^ 1]) + seed[i + 1:]
        assert not np.array_equal(expand_mask(flipped, MODULUS, DIMENSIONS)[1], mask[1]), i
    twin = crafted(np.random.default_rng(2), fold(seed))
    assert np.array_equal(pseudo_rand_gen(twin, MODULUS, DIMENSIONS)[1],
                          pseudo_rand_gen(seed, MODULUS, DIMENSIONS)[1])
    assert not np.array_equal(expand_mask(twin, MODULUS, DIMENSIONS)[1], mask[1])


@pytest.mark.parametrize("modulus", [2, 2**16, 2**32])
def test_the_mask_keeps_flowers_contract(modulus):
    """A list of int64 arrays of the shapes asked for (scalars and empty ones included), in
    [0, modulus), as Flower's; 44-byte seeds (Flower's pairwise keys) too."""
    shapes = [(), (1,), (2, 5), (0,), (4, 1, 2)]
    seed = np.random.default_rng(3).bytes(44)
    ours, flowers = expand_mask(seed, modulus, shapes), pseudo_rand_gen(seed, modulus, shapes)
    assert [(a.shape, a.dtype) for a in ours] == [(a.shape, a.dtype) for a in flowers]
    assert all(a.dtype == np.int64 and ((0 <= a) & (a < modulus)).all() for a in ours)
    assert expand_mask(seed, modulus, []) == []


def test_the_mask_is_uniform_on_the_modulus():
    """2^16 draws on [0, 2^32): 256 bins of the top byte and 256 of the bottom byte pass a
    chi-square test (255 degrees of freedom: below 330 at p ≈ 0.001), mean and variance those
    of the uniform law; on [0, 16) every value, 16 high ones included, equally often."""
    draws = expand_mask(bytes(range(32)), MODULUS, [(2**16,)])[0]
    expected = len(draws) / 256
    for byte in (draws >> 24, draws & 255):
        counts = np.bincount(byte, minlength=256)
        assert ((counts - expected) ** 2 / expected).sum() < 330
    assert abs(draws.mean() / MODULUS - 0.5) < 0.01
    assert abs(draws.var() / MODULUS**2 - 1 / 12) < 0.01
    small = np.bincount(expand_mask(bytes(range(32)), 16, [(2**14,)])[0], minlength=16)
    assert len(small) == 16 and ((small - 1024) ** 2 / 1024).sum() < 40  # 15 dof, p ≈ 0.0005


def test_seeds_and_moduli_outside_the_protocol_are_refused():
    with pytest.raises(ValueError, match="seed of 4 bytes"):
        expand_mask(bytes(4), MODULUS, DIMENSIONS)
    for modulus in (1, 3 * 2**20, 2**33):
        with pytest.raises(ValueError, match="not a power of two"):
            expand_mask(bytes(32), modulus, DIMENSIONS)


def test_flowers_mod_and_workflow_expand_with_dpfls_masks():
    """Installed at the import of dpfl's ClientApp and of its server's SecAgg+ driver, in the
    name each of Flower's modules imported; installing again changes nothing."""
    install_mask_expansion()
    for caller in CALLERS:
        assert importlib.import_module(caller).pseudo_rand_gen is expand_mask


@pytest.mark.slow
def test_the_node_installs_it_on_its_own():
    """A fresh interpreter that imports dpfl's ClientApp only (a SuperNode): the node's mod
    masks with dpfl's expansion, whatever the server runs."""
    code = ("import importlib, dpfl.client.app\n"
            "from dpfl.flower_secagg import CALLERS, expand_mask\n"
            "assert importlib.import_module(CALLERS[0]).pseudo_rand_gen is expand_mask\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("caller", CALLERS)
def test_a_flower_without_the_generator_fails_naming_it(monkeypatch, caller):
    """A Flower whose module lacks the generator, or has one of another signature, stops at the
    install, naming the internal."""
    module = importlib.import_module(caller)
    monkeypatch.delattr(module, "pseudo_rand_gen")
    with pytest.raises(RuntimeError, match=rf"{caller}\.pseudo_rand_gen\(seed, num_range"):
        install_mask_expansion()
    monkeypatch.setattr(module, "pseudo_rand_gen", lambda seed, num_range: [], raising=False)
    with pytest.raises(RuntimeError, match=rf"{caller}\.pseudo_rand_gen"):
        install_mask_expansion()


def test_a_server_on_flowers_expansion_unmasks_a_wrong_sum(tmp_path, monkeypatch):
    """dpfl's nodes mask with dpfl's expansion whatever the server runs: a server whose workflow
    still expands with Flower's generator subtracts other masks, and its model is not the
    engine's (with dpfl's expansion on both sides it is, bit for bit:
    tests/test_secure_aggregation.py)."""
    workflow = importlib.import_module(CALLERS[1])
    monkeypatch.setattr(workflow, "pseudo_rand_gen", pseudo_rand_gen)
    values = {"algorithm": "clip21-sgd2m", "num-partitions": 3, "num-server-rounds": 1,
              "seed": 2, "secure-aggregation": True, "round-timeout": 1.0,
              "results-dir": str(tmp_path)}
    run(RunConfig({**values, "run-name": "engine"}), echo=False)
    run_flower_code_path({**values, "run-name": "flower"},
                         [{"partition-id": i} for i in range(3)])
    engine, flower = (torch.load(tmp_path / n / "model.pt") for n in ("engine", "flower"))
    assert not any(torch.equal(engine[k], flower[k]) for k in engine)
