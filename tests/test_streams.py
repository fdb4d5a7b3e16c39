"""Random streams: a seeded stream's generator gets its whole state from the stream's digest,
a keyed stream (a node's secret) is a ChaCha20 keystream under the stream's HMAC; neither goes
through torch's ``manual_seed``, which keeps only 32 bits of a seed."""

import hashlib
import hmac
from collections.abc import Callable

import numpy as np
import pytest
import torch

from dpfl.privacy.randomness import (
    MT_OFFSET,
    MT_WORDS,
    Randomness,
    first_distinct,
    mt19937_state,
)

KEY = bytes(range(32))


def keyed(key: bytes = KEY, seed: int = 5, context: str = "run") -> Randomness:
    return Randomness(seed, key=key, context=context)


def test_a_torch_generator_keeps_only_the_low_32_bits_of_its_seed():
    """Why keyed streams are not seeded generators: two seeds that agree in their low 32 bits
    draw the same numbers, so a stream seeded from a 256-bit HMAC has 2³² possible draws."""
    def draw(seed: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(12345), draw(12345 + 2 ** 32))
    assert torch.equal(draw(12345), draw(12345 + 2 ** 40))


def colliding_purposes(digest: Callable[[str], bytes]) -> tuple[str, str]:
    """Two purposes whose seeds as dpfl derived them until 2026-12-06 (a stream digest's first
    8 bytes, shifted right once) agree in the low 32 bits, by a birthday search: a generator
    seeded with either drew the same numbers."""
    seen: dict[int, str] = {}
    for i in range(1_000_000):
        purpose = f"noise-{i}"
        low = (int.from_bytes(digest(purpose)[:8], "little") >> 1) & 0xFFFF_FFFF
        if low in seen:
            return seen[low], purpose
        seen[low] = purpose
    pytest.fail("no 32-bit collision among a million streams")


@pytest.mark.parametrize("mode", ["seeded", "keyed"])
def test_streams_whose_seeds_shared_32_bits_draw_different_noise(mode):
    """Such a pair of one client and round gave two releases the same noise; now each stream's
    draws depend on its whole digest."""
    if mode == "seeded":
        rng = Randomness(5)
        def digest(purpose: str) -> bytes:
            return hashlib.sha256(f"dpfl/5/3/7/{purpose}".encode()).digest()
    else:
        rng = keyed()
        def digest(purpose: str) -> bytes:
            return hmac.new(KEY, f"dpfl/5/run/3/7/{purpose}".encode(), hashlib.sha256).digest()
    first, second = colliding_purposes(digest)
    a = rng.normal([3], 7, first, (64,), torch.ones(1))
    b = rng.normal([3], 7, second, (64,), torch.ones(1))
    assert not torch.equal(a, b)
    assert (a - b).abs().max() > 0.1
    assert not torch.equal(rng.permutation(3, 7, first, 100), rng.permutation(3, 7, second, 100))


def init_genrand(seed: int) -> list[int]:
    """mt19937's state words for a 32-bit ``seed`` (Matsumoto & Nishimura's init_genrand)."""
    words = [seed & 0xFFFF_FFFF]
    for i in range(1, MT_WORDS):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFF_FFFF)
    return words


def test_the_generator_state_is_laid_out_as_seeded_streams_write_it():
    """Words written where seeded streams write them draw what torch's own seeding of those
    words draws: the layout the streams rely on, pinned."""
    state = mt19937_state()
    assert state[MT_OFFSET:MT_OFFSET + 8 * MT_WORDS].view("<u8").tolist() == init_genrand(5489)
    for seed in (0, 1, 2 ** 31 + 7):
        written = state.copy()
        written[MT_OFFSET:MT_OFFSET + 8 * MT_WORDS].view("<u8")[:] = np.asarray(
            init_genrand(seed), dtype=np.uint32)
        gen = torch.Generator()
        gen.set_state(torch.from_numpy(written))
        reference = torch.Generator().manual_seed(seed)
        assert torch.equal(torch.randn(100, generator=gen), torch.randn(100, generator=reference))
        assert torch.equal(torch.randperm(50, generator=gen),
                           torch.randperm(50, generator=reference))


def test_keyed_draws_use_no_torch_generator(monkeypatch):
    """Neither a seeded generator nor torch's global one (whose state stays as it was)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a keyed draw made a torch generator")

    monkeypatch.setattr(torch, "Generator", refuse)
    state = torch.get_rng_state()
    rng = keyed()
    assert rng.normal([0, 1], 1, "noise", (10,), torch.ones(2)).shape == (2, 10)
    assert sorted(rng.permutation(0, 1, "perm", 50).tolist()) == list(range(50))
    picks = rng.sample_without_replacement([0, 1], [30, 40], 1, "batch", 8)
    assert [len(set(p.tolist())) for p in picks] == [8, 8]
    assert len(rng.bernoulli_rows([0], [100], 1, "poisson", [0.5])) == 1
    with pytest.raises(RuntimeError, match="keyed randomness has no seeded streams"):
        rng.key(0, 1, "noise")
    assert torch.equal(state, torch.get_rng_state())


def draws(rng: Randomness, client: int = 0, server_round: int = 1) -> list[torch.Tensor]:
    return [rng.normal([client], server_round, "noise", (32,), torch.ones(1))[0],
            rng.permutation(client, server_round, "perm", 32),
            rng.bernoulli_rows([client], [64], server_round, "poisson", [0.5])[0]]


def test_the_key_holder_draws_the_same_numbers_and_nobody_else_does():
    same = draws(keyed())
    assert all(torch.equal(a, b) for a, b in zip(same, draws(keyed()), strict=True))
    for other in (keyed(key=bytes(32)), keyed(seed=6), keyed(context="other")):
        assert not torch.equal(same[0], draws(other)[0])
        assert not torch.equal(same[1], draws(other)[1])
    seeded = Randomness(5)
    assert not torch.equal(same[0], seeded.normal([0], 1, "noise", (32,), torch.ones(1))[0])
    for moved in (draws(keyed(), client=1), draws(keyed(), server_round=2)):
        assert not torch.equal(same[0], moved[0])


def test_a_client_draws_the_same_keyed_numbers_alone_or_in_a_cohort():
    rng = keyed()
    cohort = rng.normal([4, 9, 2], 1, "noise", (100,), torch.tensor([1.0, 2.0, 3.0]))
    alone = rng.normal([9], 1, "noise", (100,), torch.tensor([2.0]))
    assert torch.equal(cohort[1], alone[0])
    together = rng.sample_without_replacement([4, 9], [50, 60], 1, "batch", 5)
    assert torch.equal(together[1], rng.sample_without_replacement([9], [60], 1, "batch", 5)[0])


def test_keyed_draws_have_their_laws():
    rng = keyed()
    noise = rng.normal([0, 1, 2], 5, "noise", (200_000,), torch.tensor([0.1, 1.0, 3.0]))
    assert noise.dtype == torch.float32
    assert torch.allclose(noise.std(dim=1), torch.tensor([0.1, 1.0, 3.0]), rtol=0.01)
    assert noise.mean(dim=1).abs().max() < 0.02
    z = noise[1].double()
    assert abs(float((z ** 4).mean()) - 3.0) < 0.05  # a Gaussian's fourth moment
    # each position of a permutation of 10 is equally likely for element 0 over many streams
    firsts = torch.stack([rng.permutation(0, r, "perm", 10) for r in range(2000)]).eq(0)
    assert firsts.float().mean(dim=0).sub(0.1).abs().max() < 0.03
    kept = rng.bernoulli_rows([0], [100_000], 1, "poisson", [0.25])[0]
    assert abs(len(kept) / 100_000 - 0.25) < 0.005
    assert torch.equal(kept, kept.sort().values)


def test_a_keyed_record_keeps_its_coin_whatever_the_number_of_records():
    """Add/remove neighbours: a client with one record more keeps the same first records."""
    rng = keyed()
    fewer = rng.bernoulli_rows([0], [999], 3, "batch", [0.1])[0]
    more = rng.bernoulli_rows([0], [1000], 3, "batch", [0.1])[0]
    assert torch.equal(fewer, more[more < 999])


@pytest.mark.parametrize("mode", ["seeded", "keyed", "secure"])
def test_a_batch_is_a_uniform_subset_drawn_in_o_of_k(mode, monkeypatch):
    """Every subset equally likely (χ² over 6,000 streams): 2 of 16 (the sparse route, k ≤ n/8:
    the first distinct positions of the stream's uniforms, increasing), 3 of 6 (a permutation's
    prefix), and 3 and 4 of 6 by :func:`first_distinct` itself, where repeats are frequent; a
    batch of 64 of 6,000 records reads 72 uniforms of its stream, not a permutation of 6,000."""
    from itertools import combinations

    from scipy.stats import chisquare

    rng = {"seeded": Randomness(5), "keyed": keyed(), "secure": Randomness(5, secure=True)}[mode]
    draws = {
        (16, 2): lambda r: rng.sample_without_replacement([0], [16], r, "batch", 2)[0].tolist(),
        (6, 3): lambda r: sorted(rng.sample_without_replacement([0], [6], r, "batch", 3)[0]
                                 .tolist()),
        **{(6, k): lambda r, k=k: first_distinct(
            6, k, lambda m: rng.uniform(0, r, "batch", m)).tolist() for k in (3, 4)}}
    for (n, k), draw in draws.items():
        subsets = {s: i for i, s in enumerate(combinations(range(n), k))}
        counts = np.zeros(len(subsets))
        for r in range(6000):
            picks = draw(r)
            assert picks == sorted(set(picks))
            counts[subsets[tuple(picks)]] += 1
        assert chisquare(counts).pvalue > 1e-3, (n, k)
    assert sorted(rng.sample_without_replacement([0], [6], 1, "b", 6)[0].tolist()) == [*range(6)]
    assert len(rng.sample_without_replacement([0], [6], 1, "batch", 0)[0]) == 0
    with pytest.raises(ValueError, match="cannot draw 7 distinct positions of 6"):
        rng.sample_without_replacement([0], [6], 1, "batch", 7)
    read = []
    real = Randomness.uniform
    monkeypatch.setattr(Randomness, "uniform", lambda self, *args: read.append(args[-1]) or
                        real(self, *args))
    batch = rng.sample_without_replacement([0], [6000], 1, "batch", 64)[0].tolist()
    assert batch == sorted(set(batch)) and len(batch) == 64 and read == [72]
