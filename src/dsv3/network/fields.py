"""Finite fields GF(q) for small prime powers q, as lookup tables.

The Slim Fly (MMS) graph is defined over GF(q); q need not be prime (q = 4, 8, 9, 25, 27 are all useful),
so we build GF(p^n) as polynomials over GF(p) modulo an irreducible polynomial found by search.
Elements are the integers 0..q-1 (base-p digits = polynomial coefficients).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np

from dsv3.errors import DSV3Error


def prime_power(q: int) -> tuple[int, int] | None:
    """(p, n) with q = p**n and p prime, or None when q is not a prime power."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)  # smallest divisor is prime
    n, rest = 0, q
    while rest % p == 0:
        rest //= p
        n += 1
    return (p, n) if rest == 1 else None


def _poly_mulmod(a: list[int], b: list[int], modulus: list[int], p: int) -> list[int]:
    """(a * b) mod modulus over GF(p); coefficient lists, lowest degree first, modulus monic."""
    n = len(modulus) - 1
    prod = [0] * (len(a) + len(b) - 1)
    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            prod[i + j] = (prod[i + j] + ai * bj) % p
    for deg in range(len(prod) - 1, n - 1, -1):
        c = prod[deg]
        if c:
            for k in range(n + 1):
                prod[deg - n + k] = (prod[deg - n + k] - c * modulus[k]) % p
    return (prod + [0] * n)[:n]


def _is_irreducible(modulus: list[int], p: int) -> bool:
    """Irreducible iff no monic polynomial of degree 1..n/2 divides it (brute force; q is small)."""
    n = len(modulus) - 1
    for deg in range(1, n // 2 + 1):
        for coeffs in product(range(p), repeat=deg):
            divisor = list(coeffs) + [1]
            if _poly_divides(divisor, modulus, p):
                return False
    return True


def _poly_divides(d: list[int], f: list[int], p: int) -> bool:
    rem = list(f)
    nd = len(d) - 1
    for deg in range(len(rem) - 1, nd - 1, -1):
        c = rem[deg]
        if c:
            for k in range(nd + 1):
                rem[deg - nd + k] = (rem[deg - nd + k] - c * d[k]) % p
    return not any(rem[:nd])


@dataclass(frozen=True)
class GaloisField:
    """GF(q) with addition and multiplication tables and a primitive element."""

    q: int
    add: np.ndarray  # [q, q]
    mul: np.ndarray  # [q, q]
    primitive: int

    def neg(self, a: int) -> int:
        return int(np.flatnonzero(self.add[a] == 0)[0])

    def power(self, a: int, e: int) -> int:
        """a**e by repeated multiplication (q is small)."""
        out = 1
        for _ in range(e):
            out = int(self.mul[out, a])
        return out


def galois_field(q: int) -> GaloisField:
    """Build GF(q); raise DSV3Error when q is not a prime power."""
    pn = prime_power(q)
    if pn is None:
        raise DSV3Error(f"q = {q} is not a prime power, so GF(q) and the MMS Slim Fly graph do not exist")
    p, n = pn
    digits = [[(x // p**i) % p for i in range(n)] for x in range(q)]
    if n == 1:
        modulus = [0, 1]
    else:
        modulus = next(
            list(c) + [1] for c in product(range(p), repeat=n) if c[0] and _is_irreducible(list(c) + [1], p)
        )
    add = np.array([[_encode([(a + b) % p for a, b in zip(da, db, strict=True)], p) for db in digits]
                    for da in digits])
    if n == 1:
        mul = np.array([[(a * b) % p for b in range(q)] for a in range(q)])
    else:
        mul = np.array([[_encode(_poly_mulmod(da, db, modulus, p), p) for db in digits] for da in digits])
    return GaloisField(q=q, add=add, mul=mul, primitive=_find_primitive(mul, q))


def _encode(coeffs: list[int], p: int) -> int:
    return sum(c * p**i for i, c in enumerate(coeffs))


def _find_primitive(mul: np.ndarray, q: int) -> int:
    """Smallest element whose powers run through all q-1 non-zero elements."""
    for g in range(2 if q > 2 else 1, q):
        seen, x = set(), 1
        for _ in range(q - 1):
            x = int(mul[x, g])
            seen.add(x)
        if len(seen) == q - 1:
            return g
    raise AssertionError(f"GF({q}) has no primitive element")  # impossible for a field
