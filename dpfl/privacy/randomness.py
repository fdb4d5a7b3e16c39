"""Per-(seed, client, round, purpose) random streams, or the operating system's CSPRNG.

Every random draw of a run (mini-batch sampling, DP noise, client sampling, random subspaces)
comes from :class:`Randomness`. Seeded (the default), each draw comes from a generator keyed by
the run seed, the client id, the round and a purpose string: streams are independent across
clients, rounds and purposes, and a client draws the same numbers whether it runs alone in a
Flower ClientApp or batched with others in the engine. Anyone who knows the seed can regenerate
them: seeded randomness is for simulation and research. A stream's generator is torch's mt19937
with its 624 state words made from the SHA-256 of the stream's name (:func:`seeded_generator`),
not seeded through ``manual_seed``, which keeps only the low 32 bits of a seed: two of a run's
streams would then draw the same numbers whenever their seeds agreed in those bits, about S²/2³³
pairs among S streams, and two releases of one client would carry the same noise.

With ``secure=True`` (run-config ``secure-noise``) no draw touches a seeded generator: every
uniform, permutation and Gaussian comes from the operating system's CSPRNG (``os.urandom``),
and Gaussian noise is made resistant to floating-point attacks the way Opacus'
``secure_mode`` does it (each sample is the sum of four standard normals divided by two, in
float64, before the cast to the message's dtype): Holohan & Braghin, "Secure Random Sampling in
Differential Privacy", arXiv:2107.10138, §5.1; the attack on Gaussian DP-SGD is Jin et al.,
"Are We There Yet? Timing and Floating-Point Attacks on Differential Privacy Systems",
arXiv:2112.05307. Secure runs are not reproducible.

Keyed (``key=``, a node's secret: :mod:`dpfl.client.policy`), every stream is the ChaCha20
keystream (RFC 8439) under a 256-bit key, HMAC-SHA256 of the stream's name under the node's
secret, and its draws are made from it exactly as secure draws are made from the OS CSPRNG: the
node's owner, who holds the secret, can regenerate every draw (a run is reproducible); the
server, which knows the seed but not the secret, cannot, however much it computes. Seeding a
torch generator from that HMAC instead, as dpfl did until 2026-12-06, is not enough: torch's
CPU generator (mt19937) keeps only the low 32 bits of its seed, so a server that tried the 2³²
seeds of one stream against a client's noised upload would find its noise and strip it.
``context`` names the run configuration the streams belong to, so that two runs of one seed with
other settings draw independent noise.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SERVER = -1  # the client id used for the server's own draws (client sampling)
SECURE_SUMMANDS = 4  # standard normals summed (then halved) per secure Gaussian sample


#: where a secure draw's random bytes come from: ``source(n)`` gives ``n`` bytes
Source = Callable[[int], bytes]


#: mt19937's state words: 624, kept as 64-bit words after the state's initial seed (8 bytes),
#: its position ``left`` and ``seeded`` flag (4 bytes each) and ``next`` (8 bytes), in the bytes
#: of torch's CPU generator state (:func:`mt19937_state`)
MT_WORDS = 624
MT_OFFSET = 24


@functools.cache
def mt19937_state() -> np.ndarray:
    """The bytes of a freshly seeded CPU generator's state (next draw: a twist of the words),
    checked against mt19937's own initialisation of seed 5489 so that a layout torch changed
    stops every seeded draw in one line rather than drawing from the wrong bytes."""
    state = torch.Generator().manual_seed(5489).get_state().numpy().copy()
    expected = [5489]
    for i in range(1, 4):
        expected.append((1812433253 * (expected[-1] ^ (expected[-1] >> 30)) + i) & 0xFFFF_FFFF)
    found = state[MT_OFFSET:MT_OFFSET + 32].view("<u8").tolist()
    if found != expected or len(state) < MT_OFFSET + 8 * MT_WORDS:
        raise RuntimeError(f"torch {torch.__version__}'s CPU generator state is not laid out as "
                           f"dpfl's seeded streams expect (mt19937 words at byte {MT_OFFSET})")
    return state


def seeded_generator(digest: bytes) -> torch.Generator:
    """A CPU generator whose mt19937 state is 624 words of SHAKE-128 of ``digest``: every bit of
    the digest decides its draws."""
    state = mt19937_state().copy()
    state[MT_OFFSET:MT_OFFSET + 8 * MT_WORDS].view("<u8")[:] = np.frombuffer(
        hashlib.shake_128(digest).digest(4 * MT_WORDS), dtype="<u4")
    gen = torch.Generator()
    gen.set_state(torch.from_numpy(state))
    return gen


def keystream(key: bytes) -> Source:
    """The first ``n`` bytes of the ChaCha20 keystream under the 256-bit ``key`` (nonce 0): a
    deterministic source that nobody without the key can tell from random bytes."""
    def source(n: int) -> bytes:
        return Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(n))
    return source


def words(n: int, source: Source | None = None) -> torch.Tensor:
    """``n`` int64 words of ``source``'s bytes (None: the OS CSPRNG, ``os.urandom``)."""
    if not n:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray((source or os.urandom)(8 * n)), dtype=torch.int64)


def secure_uniform(n: int, source: Source | None = None) -> torch.Tensor:
    """``n`` float64 uniforms on (0, 1] from ``source`` (the OS CSPRNG): 53 random bits
    each."""
    return ((words(n, source) >> 11) & ((1 << 53) - 1)).double().add_(1.0).mul_(2.0 ** -53)


def secure_standard_normal(n: int, source: Source | None = None) -> torch.Tensor:
    """``n`` float64 N(0, 1) samples from ``source`` (the OS CSPRNG), each the sum of
    :data:`SECURE_SUMMANDS` Box-Muller normals divided by √SECURE_SUMMANDS (Opacus' secure
    mode; arXiv:2107.10138 §5.1)."""
    pairs = (SECURE_SUMMANDS * n + 1) // 2
    u = secure_uniform(2 * pairs, source)
    radius = u[:pairs].log().mul_(-2.0).sqrt_()
    angle = u[pairs:].mul_(2.0 * math.pi)
    normals = torch.cat([radius * angle.cos(), radius * angle.sin()])[:SECURE_SUMMANDS * n]
    return normals.reshape(SECURE_SUMMANDS, n).sum(dim=0).div_(math.sqrt(SECURE_SUMMANDS))


#: a batch of b of n records is drawn as :func:`first_distinct` positions where b ≤ n/8 (about
#: b + b²/2n uniforms, almost no repeats), as the first b of a permutation of all n above
SPARSE_BATCH = 8


def first_distinct(n: int, k: int, uniforms: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``k`` distinct positions of ``range(n)``, increasing, every k-subset equally likely: the
    first k distinct values of the positions ⌊u·n⌋ of a stream's uniforms u on [0, 1)
    (``uniforms(m)``: its first m), a repeat skipped — sequential sampling without replacement,
    whose first k distinct draws are a uniform k-subset. About k + k²/2n uniforms (the rounding
    of u·n favours no position by more than n·2⁻⁵³; ⌊u·n⌋ < n for u < 1)."""
    m = k + k * k // max(n, 1) + 8
    while True:
        # a dict keeps each position's first draw, in the order drawn
        picks = list(dict.fromkeys((uniforms(m) * n).long().tolist()))
        if len(picks) >= k:
            return torch.tensor(sorted(picks[:k]), dtype=torch.long)
        m *= 2


#: where the draws come from, weakest first: the run's seed (anyone who knows it can regenerate
#: them), a keystream under a node's secret key (only the key's holder can), the OS CSPRNG
#: (nobody)
MODES = ("seeded", "keyed", "secure")


class Randomness:
    """Every random draw of one run: seeded streams, keyed streams (``key``), or the OS CSPRNG
    with ``secure``."""

    def __init__(self, seed: int, *, secure: bool = False, key: bytes | None = None,
                 context: str = "") -> None:
        if secure and key is not None:
            raise ValueError("secure randomness takes no key")
        self.seed = seed
        self.secure = secure
        self._secret = key
        self.context = context

    @property
    def mode(self) -> str:
        """One of :data:`MODES`."""
        return "secure" if self.secure else "keyed" if self._secret is not None else "seeded"

    def digest(self, client: int, server_round: int, purpose: str) -> bytes:
        """The SHA-256 of seeded stream (client, round, purpose)'s name (seeded randomness
        only: keyed and secure draws never come from a generator)."""
        if self.mode != "seeded":
            raise RuntimeError(f"{self.mode} randomness has no seeded streams: draw through "
                               f"Randomness' methods")
        return hashlib.sha256(f"dpfl/{self.seed}/{client}/{server_round}/{purpose}".encode()
                              ).digest()

    def key(self, client: int, server_round: int, purpose: str) -> int:
        """A 63-bit number of stream (client, round, purpose)'s digest, a seed for another
        run's randomness (streams draw from their whole digest: :meth:`generator`)."""
        return int.from_bytes(self.digest(client, server_round, purpose)[:8], "little") >> 1

    def generator(self, client: int, server_round: int, purpose: str) -> torch.Generator:
        """The seeded generator of stream (client, round, purpose)."""
        return seeded_generator(self.digest(client, server_round, purpose))

    def source(self, client: int, server_round: int, purpose: str) -> Source | None:
        """Where the secure draws of stream (client, round, purpose) come from: the keystream
        under HMAC-SHA256 of the stream's name under the node's secret (keyed), or None: the OS
        CSPRNG (secure)."""
        if self.secure:
            return None
        if self._secret is None:
            raise RuntimeError("seeded randomness draws from its generators")
        text = f"dpfl/{self.seed}/{self.context}/{client}/{server_round}/{purpose}".encode()
        return keystream(hmac.new(self._secret, text, hashlib.sha256).digest())

    def normal(self, clients: Sequence[int], server_round: int, purpose: str, shape: Sequence[int],
               std: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Gaussian noise ``[C, *shape]``, row ``i`` from client ``clients[i]``'s stream
        and scaled by ``std[i]``. Draws are made on the CPU so that they do not depend
        on the device."""
        shape = tuple(shape)
        scale = std.reshape(-1, *([1] * len(shape)))
        if self.mode != "seeded":
            n = math.prod(shape)
            rows = torch.cat([secure_standard_normal(n, self.source(c, server_round, purpose))
                              for c in clients] or [torch.empty(0, dtype=torch.float64)])
            rows = rows.reshape(len(clients), *shape)
            return (rows * scale.to(dtype=torch.float64, device="cpu")).to(dtype).to(device)
        noise = torch.empty((len(clients), *shape), dtype=dtype)
        # each row drawn with its std in one pass: for 16 entries or more, the numbers of
        # torch.randn(shape, generator) times the std rounded to ``dtype``
        stds = scale.to(dtype=dtype, device="cpu").reshape(-1).tolist()
        for row, client, s in zip(noise, clients, stds, strict=True):
            row.normal_(0.0, s, generator=self.generator(client, server_round, purpose))
        return noise.to(device)

    def permutation(self, client: int, server_round: int, purpose: str, n: int) -> torch.Tensor:
        """A uniformly random permutation of ``range(n)`` (int64) from the stream (keyed and
        secure: the order of n random 64-bit words, uniform but where two words tie, about
        n²/2⁶⁵)."""
        if self.mode != "seeded":
            return torch.argsort(words(n, self.source(client, server_round, purpose)),
                                 stable=True)
        return torch.randperm(n, generator=self.generator(client, server_round, purpose))

    def uniform(self, client: int, server_round: int, purpose: str, n: int) -> torch.Tensor:
        """The first ``n`` float64 uniforms of stream (client, round, purpose) on [0, 1), 53
        random bits each (a longer draw of a seeded or keyed stream begins with them; secure
        draws are fresh every call)."""
        if self.mode == "seeded":
            gen = self.generator(client, server_round, purpose)
            return torch.rand(n, generator=gen, dtype=torch.float64)
        # 1 − u of a uniform on (0, 1] that is a multiple of 2⁻⁵³: exact
        return secure_uniform(n, self.source(client, server_round, purpose)).neg_().add_(1.0)

    def sample_without_replacement(self, clients: Sequence[int], sizes: Sequence[int],
                                   server_round: int, purpose: str, k: int) -> list[torch.Tensor]:
        """For each client, ``k`` distinct positions of ``range(size)``, every k-subset equally
        likely: where ``k`` is at most a :data:`SPARSE_BATCH`-th of ``size``, the increasing
        :func:`first_distinct` positions of its stream's uniforms (O(k) draws), else the first
        ``k`` of the stream's permutation of ``range(size)``."""
        out = []
        for client, size in zip(clients, sizes, strict=True):
            if not 0 <= k <= size:
                raise ValueError(f"cannot draw {k} distinct positions of {size}")
            out.append(first_distinct(size, k, functools.partial(
                self.uniform, client, server_round, purpose)) if SPARSE_BATCH * k <= size else
                self.permutation(client, server_round, purpose, size)[:k])
        return out

    def bernoulli_rows(self, clients: Sequence[int], sizes: Sequence[int], server_round: int,
                       purpose: str, rates: Sequence[float]) -> list[torch.Tensor]:
        """For each client, the positions in ``range(size)`` kept by independent coin flips of
        probability ``rates[i]`` (Poisson sampling), increasing. Record j's coin is the j-th
        uniform of the client's stream, whatever ``size`` is: a client with one record more
        (add/remove neighbours) keeps the same first ``size`` records."""
        out = []
        for client, size, rate in zip(clients, sizes, rates, strict=True):
            coins = self.uniform(client, server_round, purpose, size)
            # NumPy's scan for the kept positions: the same int64 positions, a third of the time
            out.append(torch.from_numpy(np.flatnonzero(coins.numpy() < rate)))
        return out
