"""Exact float32 contractions (Ozaki scheme) with a single, correct final rounding.

Why: plain float32/float64 GEMMs change bits with thread count, BLAS, operand
layout, row batching and K-splitting, because the order in which the K products
are added is an implementation detail.  The only summation result that is
independent of *every* order is the exact one.  This module therefore returns
``RN32(sum_k x_k * w_k)`` -- the exact real dot product rounded once to the
nearest float32 (ties to even).  That value is a mathematical function of the
inputs, so it is bitwise identical for any thread count, BLAS, device, row
split, K split across ranks, and slice/partial summation order.  Zero results
are returned as +0.0 (the sign of an exact zero is canonicalised).

How (Ozaki): each float32 operand row is cut into "slices" of ``b`` bits on a
power-of-two grid anchored at the row's top exponent.  Slice values are
integers ``|q| <= 2**b``; ``b`` is chosen from the *total* K so that
``K * 2**(2b) <= 2**53``.  Then every float64 GEMM of integer slices is exact
in any summation order (every partial sum is an integer below 2**53), and so is
summing such partials across K-shards (all-reduce SUM in any order).  The few
exact slice products are finally combined by ``round_sum_f32``, which certifies
the rounding with a rigorous error bound and, for the rare uncertain elements,
decides it exactly with error-free transformations (TwoSum expansions).

Single process, ``exact_matmul`` takes a cheaper route to the *same* value: a
float64 GEMM whose rounding to float32 is certified by an a-priori error bound
that holds for every summation order, with exact recomputation of the rare
uncertified elements.  Only the K-sharded API needs the slice partials.

Assumptions: IEEE float64 with round-to-nearest, a classical (non-Strassen)
float64 GEMM, and no flush-to-zero of float32 subnormals
(``torch.set_flush_denormal(False)``, the default).
"""
from __future__ import annotations

import torch

__all__ = [
    "slice_width", "exact_exponents", "exact_partials", "exact_finalize",
    "exact_matmul", "exact_dot_last", "round_sum_f32", "check_finite",
]

_SENTINEL = -1000            # exponent of an all-zero row; max-reduces correctly
_F32_INF_KEY = 0x7F800000    # ordered integer key of +inf
_TWO128 = 2.0 ** 128         # stands in for +-inf when forming rounding boundaries
_BIG = 1 << 20
_CHUNK = 512                 # K chunk of the certified float64 GEMM (tighter error bound)
_GROUP = 64                  # group size of the certified two-level row sum


def check_finite(t: torch.Tensor, name: str) -> None:
    """Deterministic orders need finite float32 operands (inf*0 has no exact value)."""
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains inf or nan; the 'blocked' and 'exact' "
                         "orders require finite inputs")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (R, K); also valid for K == 0."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _ceil_log2(n: int) -> int:
    return max(int(n) - 1, 0).bit_length()


def slice_width(k_total: int) -> int:
    """Bits per slice so that K products of two ``|q| <= 2**b`` integers sum exactly."""
    return (53 - _ceil_log2(max(int(k_total), 1))) // 2


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2**k`` for int tensors ``-1022 <= k <= 1023`` (bit construction)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exp(v: torch.Tensor) -> torch.Tensor:
    """Exponent e with ``|v| < 2**e`` (frexp), as int64."""
    return torch.frexp(v).exponent.to(torch.int64)


def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


# --------------------------------------------------------------------------- rounding
def _key_to_f64(k: torch.Tensor):
    """Ordered int key -> (float64 value with +-inf mapped to +-2**128, even flag)."""
    bits = torch.where(k >= 0, k, (-k) - (1 << 31)).to(torch.int32)
    f = bits.view(torch.float32).double()
    f = torch.where(torch.isinf(f), torch.copysign(torch.full_like(f, _TWO128), f), f)
    return f, (k.abs() & 1) == 0


def _expansion_sign_minus(h, m):
    """Exact sign of (sum(h) - m) for a nonoverlapping expansion h (Shewchuk)."""
    q, comps = -m, []
    for e in h:
        q, err = _two_sum(q, e)
        comps.append(err)
    comps.append(q)
    sign = torch.zeros_like(m)
    for c in reversed(comps):   # most significant nonzero component decides
        sign = torch.where(sign == 0, torch.sign(c), sign)
    return sign


def _round_exact(v: torch.Tensor) -> torch.Tensor:
    """RN32 of the exact row sums of ``v`` (F, m) float64, decided without error.

    Builds a nonoverlapping expansion of each row sum (Grow-Expansion, exact),
    then bisects over the totally ordered float32 keys: key k is <= the answer
    iff the exact sum lies above the rounding boundary between k-1 and k (or on
    it and k is even).  33 exact sign tests; only used for rare elements.
    """
    h = []
    for j in range(v.shape[1]):
        q, new = v[:, j], []
        for e in h:
            q, err = _two_sum(q, e)
            new.append(err)
        new.append(q)
        h = new
    lo = torch.full(v.shape[:1], -_F32_INF_KEY, dtype=torch.int64, device=v.device)
    hi = torch.full(v.shape[:1], _F32_INF_KEY + 1, dtype=torch.int64, device=v.device)
    for _ in range(33):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        fk, even = _key_to_f64(mid)
        fprev, _ = _key_to_f64(mid - 1)
        sign = _expansion_sign_minus(h, (fk + fprev) * 0.5)   # boundary is exact in f64
        up = (sign > 0) | ((sign == 0) & even)
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    bits = torch.where(lo >= 0, lo, (-lo) - (1 << 31)).to(torch.int32)
    return bits.view(torch.float32) + 0.0


def round_sum_f32(terms, force_exact: bool = False) -> torch.Tensor:
    """Correctly rounded float32 of the exact elementwise sum of float64 ``terms``.

    Fast path: a fixed-order float64 sum ``s`` plus a rigorous bound ``E`` on its
    error; where ``RN32(s-E) == RN32(s+E)`` the answer is certified (rounding is
    monotone).  Remaining elements go to ``_round_exact``.  Either way the result
    depends only on the exact sum, never on the order of ``terms``.
    """
    terms = list(terms)
    m = len(terms)
    s = terms[0].clone()
    a = terms[0].abs()
    for t in terms[1:]:
        s += t
        a += t.abs()
    # |s - S| <= (m-1)u*sum|t|; the extra 2**-50 covers rounding of s -+ E.
    err = a.mul_((m + 1) * 2.0 ** -52 + 2.0 ** -50)
    out = (s - err).float()
    hi = (s + err).float()
    bad = torch.ones_like(out, dtype=torch.bool) if force_exact else out != hi
    if bool(bad.any()):
        idx = bad.nonzero(as_tuple=True)
        out[idx] = _round_exact(torch.stack([t[idx] for t in terms], dim=1))
    return out.add_(0.0)


# --------------------------------------------------------------------------- exponents
def _row_exponents(t2: torch.Tensor) -> torch.Tensor:
    """(R, K) float32 -> (R, 2) int32 ``[top, -bottom]``.

    ``|t| < 2**top`` and every element is a multiple of ``2**bottom`` (float32
    ulp bound, >= 2**-149).  Both columns combine across K-shards by MAX.
    """
    R, K = t2.shape
    if K == 0:
        return torch.full((R, 2), _SENTINEL, dtype=torch.int32, device=t2.device)
    a = t2.double().abs()
    amax = a.amax(-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("operand contains inf or nan; the 'exact' order requires finite inputs")
    lsb = torch.where(a == 0, _BIG, (_exp(a) - 24).clamp_min(-149))
    zero = amax == 0
    top = torch.where(zero, _SENTINEL, _exp(amax))
    negbot = torch.where(zero, _SENTINEL, -lsb.amin(-1))
    return torch.stack([top, negbot], -1).to(torch.int32)


def exact_exponents(x: torch.Tensor, w_t: torch.Tensor):
    """Per-row grid exponents ``(ex (..., 2), ew (N, 2))`` for ``exact_partials``.

    A K-sharded caller computes these on its shard and all-reduces them with MAX,
    so every rank slices on the same grid and partials add exactly.
    """
    ex = _row_exponents(_rows(x)).reshape(*x.shape[:-1], 2)
    return ex, _row_exponents(_rows(w_t))


def _num_slices(e: torch.Tensor, b: int) -> int:
    live = e[..., 0] > _SENTINEL // 2
    if not bool(live.any()):
        return 0
    span = (e[..., 0] + e[..., 1])[live].to(torch.int64)   # top - bottom
    return int(((span + b - 1) // b).max().clamp_min(1))


def _slices(t2: torch.Tensor, e: torch.Tensor, b: int, nslices: int) -> torch.Tensor:
    """(S, R, K) float64 integer slices: ``t = sum_s q_s * 2**(top - (s+1) b)`` exactly."""
    top = e[:, 0].to(torch.int64)
    top = torch.where(top > _SENTINEL // 2, top, torch.zeros_like(top))
    y = t2.double() * _pow2(b - top)[:, None]       # exact, |y| < 2**b
    out = torch.empty((nslices,) + tuple(t2.shape), dtype=torch.float64, device=t2.device)
    for s in range(nslices):
        q = torch.round(y)                           # exact integer, |q| <= 2**b
        out[s] = q
        y = (y - q) * float(2 ** b)                  # exact residual, rescaled
    if y.numel() and bool((y != 0).any()):
        raise ValueError("exact slicing incomplete: exponents do not cover the operand "
                         "(were they all-reduced with MAX over every shard?)")
    return out


# --------------------------------------------------------------------------- matmul
def exact_partials(x: torch.Tensor, w_t: torch.Tensor, exps, k_total: int | None = None):
    """Exact integer slice products ``C[s, t, ..., n]`` (float64) for a K-shard.

    ``exps`` must be the MAX over all shards of ``exact_exponents``; ``k_total``
    the full contracted length.  Partials of different shards may then be summed
    (all-reduce SUM, gather + sum) in *any* order without rounding.
    """
    check_finite(x, "x")
    check_finite(w_t, "w_t")
    K, N = x.shape[-1], w_t.shape[0]
    b = slice_width(k_total if k_total is not None else K)
    ex, ew = exps
    ex2 = ex.reshape(-1, 2)
    sx, sw = _num_slices(ex2, b), _num_slices(ew, b)
    xs = _slices(_rows(x), ex2, b, sx)
    ws = _slices(_rows(w_t), ew, b, sw)
    M = xs.shape[1]
    c = xs.reshape(sx * M, K) @ ws.reshape(sw * N, K).T     # one exact DGEMM
    c = c.reshape(sx, M, sw, N).permute(0, 2, 1, 3)
    return c.reshape(sx, sw, *x.shape[:-1], N)


def exact_finalize(partials: torch.Tensor, exps, k_total: int) -> torch.Tensor:
    """Round the (summed) exact partials to float32 once, correctly."""
    b = slice_width(k_total)
    ex, ew = exps
    sx, sw = partials.shape[:2]
    batch, N = ex.shape[:-1], ew.shape[0]
    if sx == 0 or sw == 0:
        return torch.zeros(*batch, N, dtype=torch.float32, device=partials.device)
    c = partials.reshape(sx, sw, -1, N)
    # zero rows carry the sentinel; their partials are 0, any in-range scale works
    tx = ex.reshape(-1, 2)[:, 0].to(torch.int64).clamp_min(-200)
    tw = ew[:, 0].to(torch.int64).clamp_min(-200)
    terms = []
    for d in range(sx + sw - 1):                      # most significant first
        for s in range(max(0, d - sw + 1), min(d, sx - 1) + 1):
            t = d - s
            scale_x = _pow2(tx - (s + 1) * b)[:, None]
            scale_w = _pow2(tw - (t + 1) * b)[None, :]
            terms.append(c[s, t] * scale_x * scale_w)   # exact power-of-two scaling
    return round_sum_f32(terms).reshape(*batch, N)


def _exact_via_slices(x, w_t):
    K = x.shape[-1]
    exps = exact_exponents(x, w_t)
    return exact_finalize(exact_partials(x, w_t, exps, K), exps, K)


def exact_matmul(x: torch.Tensor, w_t: torch.Tensor, exps=None, *, method: str = "auto",
                 w_cache: dict | None = None):
    """``RN32(x @ w_t.T)`` computed exactly; bitwise identical everywhere.

    With ``exps`` (already all-reduced) the Ozaki slice path is used.  Without,
    ``method='auto'`` first runs float64 GEMMs over K-chunks of 512 (summed in a
    fixed order) and certifies each element's rounding with the Cauchy-Schwarz
    bound ``|err| <= (512 + K/512) u ||x_i|| ||w_j||`` (x2 margin), valid for *any*
    summation order inside the GEMM; uncertified elements (measured 0.06-0.3%
    for random data) are recomputed exactly by ``_dot_rows``.  Both paths return
    the same correctly rounded value, so the shortcut cannot change any bit;
    ``method='slices'`` forces the Ozaki path.  ``w_cache``: a dict kept by
    the caller for a constant ``w_t`` (stores its float64 copy and row norms).
    """
    if x.dtype != torch.float32 or w_t.dtype != torch.float32:
        raise ValueError(f"exact matmul needs float32 operands, got {x.dtype}, {w_t.dtype}")
    K, N = x.shape[-1], w_t.shape[0]
    if exps is not None:
        return exact_finalize(exact_partials(x, w_t, exps, K), exps, K)
    if method == "slices":
        return _exact_via_slices(x, w_t)
    if method != "auto":
        raise ValueError(f"unknown exact method {method!r}")
    x2 = _rows(x)
    cache = {} if w_cache is None else w_cache
    if "wd" not in cache:
        wd = w_t.double()
        cache["wn"] = torch.einsum("ij,ij->i", wd, wd).sqrt_()
        cache["wd"] = wd
    wd, wn = cache["wd"], cache["wn"]
    xd = x2.double()
    # exact squares summed in any order: relative error <= K u, covered by the x2 margin
    nx = torch.einsum("ij,ij->i", xd, xd).sqrt_()
    # squares of finite float32 cannot overflow float64: a non-finite norm means inf/nan input
    if not (bool(torch.isfinite(nx).all()) and bool(torch.isfinite(wn).all())):
        raise ValueError("x or w_t contains inf or nan; the 'exact' order requires finite inputs")
    # K in chunks of _CHUNK, chunk results added in a fixed order: any GEMM order
    # inside a chunk errs by <= (c-1)u*sum|p|, the chunk sum by <= (nc-1)u*sum|p|.
    nc = -(-K // _CHUNK) if K else 1
    r = xd[:, :_CHUNK] @ wd[:, :_CHUNK].T
    if nc > 1:
        t = torch.empty_like(r)
        for c in range(1, nc):
            sl = slice(c * _CHUNK, (c + 1) * _CHUNK)
            r += torch.mm(xd[:, sl], wd[:, sl].T, out=t)
    depth = min(K, _CHUNK) + nc + 2
    bound = nx.mul_(2 * depth * 2.0 ** -53 + 2.0 ** -50)[:, None] * wn[None, :]
    out = (r - bound).float()
    bad = out != r.add_(bound).float()
    del r, bound
    rows, cols = bad.nonzero(as_tuple=True)
    if rows.numel() > max(256, out.numel() // 8):   # pathological cancellation: slice it all
        return _exact_via_slices(x, w_t)
    if rows.numel():
        out[rows, cols] = _dot_rows(x2, w_t, rows, cols)
    return out.add_(0.0).reshape(*x.shape[:-1], N)


# --------------------------------------------------------------------------- dot
def _dot_rows(a2, b2, ia=None, ib=None, certify: bool = True) -> torch.Tensor:
    """RN32 of exact row dots ``sum_k a2[ia[r], k] * b2[ib[r], k]`` (float32 rows).

    Products of float32 are exact in float64 (<= 48 significant bits, so every
    product is a multiple of ``2**(e - 48)``).  They are sliced on a per-row grid
    with ``K * 2**w <= 2**53``, so each slice sums exactly with ``torch.sum``
    whatever its internal order/threading.  Processed in cache-sized chunks.
    """
    rows = a2.shape[0] if ia is None else ia.numel()
    K = a2.shape[1]
    out = torch.zeros(rows, dtype=torch.float32, device=a2.device)
    if K == 0:
        return out
    w = 53 - _ceil_log2(K)
    step = max(1, (1 << 17) // K)
    for i in range(0, rows, step):
        j = min(rows, i + step)
        pa = a2[i:j] if ia is None else a2[ia[i:j]]
        pb = b2[i:j] if ib is None else b2[ib[i:j]]
        p = pa.double().mul_(pb)
        ap = p.abs()
        amax = ap.amax(-1)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("operands contain inf or nan; the 'exact' order requires finite inputs")
        # stage 1: two-level sum, any order inside each torch.sum; error
        # <= (g + K/g) u * sum|p|.  Certifies almost all rows cheaply.
        g = min(_GROUP, K)
        ng = -(-K // g)
        s1 = torch.nn.functional.pad(p, (0, ng * g - K)).view(-1, ng, g).sum(-1).sum(-1)
        e1 = ap.sum(-1).mul_(2 * (g + ng + 2) * 2.0 ** -53 + 2.0 ** -50)
        lo = (s1 - e1).float()
        ok = lo == (s1 + e1).float()
        if not certify:
            ok = torch.zeros_like(ok)
        out[i:j] = lo
        if bool(ok.all()):
            continue
        keep = (~ok).nonzero().squeeze(1)
        p, ap, amax = p[keep], ap[keep], amax[keep]
        live = amax != 0
        amin = ap.masked_fill_(ap == 0, float("inf")).amin(-1)   # smallest nonzero |p|
        top = torch.where(live, _exp(amax), 0)
        bottom = torch.where(live, _exp(amin) - 48, 0)
        nsl = int(((top - bottom) + w - 1).div(w, rounding_mode="floor").max().clamp_min(1))
        y = p.mul_(_pow2(w - top)[:, None])                  # exact, |y| < 2**w
        terms = []
        for sl in range(nsl):
            q = torch.round(y)
            terms.append(q.sum(-1).mul_(_pow2(top - (sl + 1) * w)))
            if sl + 1 < nsl:
                y = y.sub_(q).mul_(float(2 ** w))             # exact residual, rescaled
        out[i + keep] = round_sum_f32(terms)
    return out.add_(0.0)


def exact_dot_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``RN32(sum(a * b, -1))`` exactly (broadcasting), independent of any order."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"exact dot_last needs float32 operands, got {a.dtype}, {b.dtype}")
    a, b = torch.broadcast_tensors(a, b)
    return _dot_rows(_rows(a), _rows(b)).reshape(a.shape[:-1])
