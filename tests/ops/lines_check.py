"""Direct checks of a kernel's relaxation (an `InterceptRelaxation`), without CROWN, shared by
the tests of the smooth-function families (exponential, periodic, gated).

For thousands of float32 intervals of every kind (narrow, wide, huge, saturated, across the
kinks and inflection points, degenerate, infinite, and for functions with a domain: inside it,
touching its edge and leaving it) and random feasible alphas, the float32 lines must hold below
/ above f on a dense float64 grid with the endpoints, the piece boundaries, the extrema and the
touching points of every line -- with no tolerance beyond float64 evaluation error -- and
never be NaN (an infinite intercept is allowed: it is the vacuous bound where no line exists);
IBP must hold f on the same grid. Where a line is finite and sloped, it must touch f (its
intercept is the tightest for its slope), up to its float32 rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from shardbound.runtime.ops.intercepts import ALPHA_SPAN, F64

CUT = 1e5       # infinite interval ends are cut here for the grid


def make_kernel(cls, **attrs):
    return cls("node", ["x"], [(1,)], shape=(1,), **attrs)


def intervals(rng, domain: str = "real", n: int = 150, scale: float = 1.0):
    """(lo, hi) float32, n of each kind. domain: "real", "positive" (x > 0, and intervals that
    touch 0 or reach below it), "negative" (the mirror), "nonnegative" (x >= 0 and below)."""
    kinds = []
    if domain == "real":
        c = rng.uniform(-6, 6, n) * scale
        kinds += [(c, c + rng.uniform(0, 1, n) * 1e-7 * np.maximum(1, np.abs(c))),   # narrow
                  (c - 1e-7, c + 1e-7),
                  (-rng.uniform(0, 1e4, n), rng.uniform(0, 1e4, n)),                 # wide
                  (np.full(n, -1e4), np.full(n, 1e4)),
                  (-rng.uniform(0, 1e30, n), rng.uniform(0, 1e30, n))]              # huge
        for side in (-30.0, 30.0):                                                   # saturated
            c = side * scale + rng.uniform(-3, 3, n)
            kinds.append((c - rng.uniform(0, 5, n), c + rng.uniform(0, 5, n)))
        kinds += [(-rng.uniform(0, 5, n) * scale, rng.uniform(0, 5, n) * scale),     # across 0
                  (-rng.uniform(0, 1e-3, n), rng.uniform(0, 50, n)),
                  (np.full(n, -1e-30), rng.uniform(0, 1e-30, n))]
        c = rng.uniform(-8, 8, n) * scale
        kinds += [(c - rng.uniform(0, 4, n) * scale, c + rng.uniform(0, 4, n) * scale),
                  (c, c),                                                            # degenerate
                  (np.concatenate([np.full(n // 2, -np.inf), rng.uniform(-3, 3, n - n // 2)]),
                   np.concatenate([rng.uniform(-3, 3, n // 2), np.full(n - n // 2, np.inf)]))]
    else:
        c = np.exp(rng.uniform(np.log(1e-3), np.log(50), n)) * scale
        kinds += [(c, c * (1 + rng.uniform(0, 1, n) * 1e-6)),                         # narrow
                  (c - 1e-7 * c, c + 1e-7 * c),
                  (rng.uniform(1e-6, 1e-2, n), rng.uniform(1, 1e4, n)),               # wide
                  (np.full(n, 1e-3), np.full(n, 1e4)),
                  (rng.uniform(1, 10, n), rng.uniform(1e20, 1e30, n)),                # huge
                  (rng.uniform(1e-30, 1e-20, n), rng.uniform(1e-3, 1, n)),            # near 0
                  (rng.uniform(1e-38, 1e-36, n), rng.uniform(1e-36, 1e-30, n)),
                  (c, c),                                                             # degenerate
                  (np.zeros(n), rng.uniform(0, 5, n)),                                # touch 0
                  (-rng.uniform(0, 1, n), rng.uniform(0, 5, n)),                      # leave it
                  (-rng.uniform(1, 5, n), -rng.uniform(0, 1, n)),
                  (rng.uniform(1, 3, n), np.full(n, np.inf))]
        c = rng.uniform(0.05, 8, n) * scale
        kinds.append((c, c + rng.uniform(0, 4, n) * scale))
    lo = np.concatenate([k[0] for k in kinds]).astype(np.float32)
    hi = np.concatenate([k[1] for k in kinds]).astype(np.float32)
    lo, hi = lo, np.maximum(lo, hi)
    if domain == "negative":
        lo, hi = -hi, -lo
    return lo, hi


def lines(kernel, lo, hi, alpha=None):
    """(lower slope, lower icpt, upper slope, upper icpt) as float64 numpy, one per interval."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(1, 1, -1)
    with torch.no_grad():
        got = kernel.relax(t(lo), t(hi), None if alpha is None else
                           torch.from_numpy(alpha).reshape(1, 1, 2, -1))
    return [np.asarray(v.to(torch.float64).expand(1, 1, lo.size).reshape(-1).numpy())
            for v in (got.lower_slope, got.lower_icpt, got.upper_slope, got.upper_icpt)]


def grid(kernel, lo, hi, slopes, points: int = 401):
    """float64 points per interval (rows): a dense grid with both ends, the piece boundaries,
    the extrema and the points where f' equals each slope on each piece."""
    a = np.clip(lo.astype(np.float64), -CUT, CUT)
    b = np.clip(hi.astype(np.float64), -CUT, CUT)
    dense = a[:, None] + (b - a)[:, None] * np.linspace(0, 1, points)[None]
    cols = [np.clip(dense, a[:, None], b[:, None])]
    extra = []
    l64, h64 = torch.from_numpy(a), torch.from_numpy(b)
    with torch.no_grad():
        for index, pa, pc, inside, _ in kernel._pieces_within(l64, h64):
            for w in slopes:
                x = kernel.touch64(torch.from_numpy(w), index, pa, pc)
                extra.append(torch.minimum(torch.maximum(x, pa), pc).numpy())
            extra += [pa.numpy(), pc.numpy()]
    extra += [np.full_like(a, p) for p in kernel.critical_points]
    extra.append(np.zeros_like(a))
    cols.append(np.clip(np.nan_to_num(np.stack(extra, axis=1)), a[:, None], b[:, None]))
    return np.concatenate(cols, axis=1)


def _finite(v):
    return np.where(np.isfinite(v), np.abs(v), 0.0)


def check(kernel, ref, lo, hi, alpha=None, points: int = 401, touch: bool = True):
    """Assert the lines (and, without alpha, IBP) are sound on the grid; return the largest
    gap between the lines per interval (inf where a line is infinite)."""
    name = type(kernel).__name__
    wl, bl, wu, bu = lines(kernel, lo, hi, alpha)
    for v in (wl, bl, wu, bu):
        assert not np.isnan(v).any(), f"{name}: NaN in the lines"
    assert np.isfinite(wl).all() and np.isfinite(wu).all(), f"{name}: infinite slope"
    x = grid(kernel, lo, hi, (wl, wu), points)
    with np.errstate(all="ignore"):
        f = ref(x)
        low = wl[:, None] * x + bl[:, None]
        up = wu[:, None] * x + bu[:, None]
    defined = ~np.isnan(f)
    err = 2.0 ** -50 * (_finite(f) + _finite(wl[:, None] * x) + _finite(bl)[:, None]
                        + _finite(wu[:, None] * x) + _finite(bu)[:, None]) + 1e-300
    for bad, what in (((low > f + err) & defined, "lower"), ((up < f - err) & defined, "upper")):
        if bad.any():
            i, j = (int(v[0]) for v in np.nonzero(bad))
            raise AssertionError(f"{name}: {what} line wrong at x = {x[i, j]!r} on "
                                 f"[{lo[i]!r}, {hi[i]!r}] (f = {f[i, j]!r}; lines {wl[i]!r} "
                                 f"{bl[i]!r} / {wu[i]!r} {bu[i]!r})")
    if alpha is None:
        with torch.no_grad():
            il, iu = kernel.ibp((torch.from_numpy(lo), torch.from_numpy(hi)))
        il, iu = il.double().numpy()[:, None], iu.double().numpy()[:, None]
        bad = defined & ((il > f + err) | (iu < f - err))
        assert not bad.any(), (name, "IBP", lo[bad.any(1)][:3], hi[bad.any(1)][:3])
        assert not (np.isnan(il).any() or np.isnan(iu).any()), (name, "IBP NaN")
    if touch:
        _check_touching(name, kernel, lo, hi, x, f, (wl, bl, wu, bu))
    with np.errstate(all="ignore"):
        return np.where(defined, up - low, 0).max(axis=1)


def _check_touching(name, kernel, lo, hi, x, f, lines_):
    """A finite sloped line touches f up to a few float32 ulps of its terms."""
    wl, bl, wu, bu = lines_
    l64, h64 = torch.from_numpy(lo.astype(np.float64)), torch.from_numpy(hi.astype(np.float64))
    sloped = kernel.sloped64(l64, torch.maximum(h64, l64)).numpy()
    step = np.where(sloped, (hi.astype(np.float64) - lo) / (x.shape[1] - 1), 0)
    with np.errstate(all="ignore"):
        for w, b, gap in ((wl, bl, f - (wl[:, None] * x + bl[:, None])),
                          (wu, bu, (wu[:, None] * x + bu[:, None]) - f)):
            ok = sloped & (w != 0) & np.isfinite(b)
            fd = np.where(np.isfinite(f), f, 0)
            ulps = 16 * 2.0 ** -24 * (np.abs(x * w[:, None]).max(1) + np.abs(fd).max(1)
                                      + np.abs(b)) + 2e-37
            slack = ulps + step * np.abs(w) * 2 + step * np.nanmax(np.abs(np.diff(fd, axis=1)), 1)
            loose = ok & (np.nanmin(np.where(np.isnan(gap), np.inf, gap), axis=1) > slack)
            assert not loose.any(), (name, lo[loose][:3], hi[loose][:3])


def alpha_sets(rng, n: int):
    """Random feasible alphas and the corners of the feasible box, (2, n) float32 each."""
    sets = [rng.uniform(0, ALPHA_SPAN, (2, n)).astype(np.float32)]
    sets += [np.full((2, n), v, np.float32) for v in (0.0, ALPHA_SPAN)]
    sets.append(np.stack([np.zeros(n), np.full(n, ALPHA_SPAN)]).astype(np.float32))
    return sets


def check_all(kernel, ref, lo, hi, rng, points: int = 401):
    """CROWN's lines and alpha's, IBP; returns CROWN's gaps."""
    gaps = check(kernel, ref, lo, hi, points=points)
    for alpha in alpha_sets(rng, lo.size):
        check(kernel, ref, lo, hi, alpha, points=points)
    return gaps


def position_independent(kernel, lo, hi):
    """The lines, IBP and forward bits of an element do not depend on where it sits."""
    whole = lines(kernel, lo, hi)
    for start in (1, 7, 33):
        part = lines(kernel, lo[start:start + 37], hi[start:start + 37])
        for a, b in zip(whole, part):
            assert np.array_equal(a[start:start + 37], b), type(kernel).__name__
    x = torch.from_numpy(lo[np.isfinite(lo)].copy())
    with torch.no_grad():
        y = kernel.forward(x)
        assert torch.equal(y[5:45], kernel.forward(x[5:45].clone()))


def to64(t):
    return t.to(F64)


# -- compiled zoo models ---------------------------------------------------------------------------
def zoo_margins(tmp_path, name: str, radius: float = 0.15, seed: int = 0, summation="blocked"):
    """{method: lower bounds of the margins f_c - f_j} of a tests/zoo.py model on one box
    (c the class at the box centre), and the verifier."""
    import onnx
    import zoo
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions
    from shardbound.runtime import load

    model, shape = zoo.build(name)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    out = tmp_path / f"{name}_{summation}"
    compile_model(str(path), str(out), PassOptions(summation=summation))
    verifier = load(str(out))
    rng = np.random.default_rng(seed)
    centre = rng.uniform(-0.5, 0.5, int(np.prod(shape))).astype(np.float32)
    lo, hi = centre - np.float32(radius), centre + np.float32(radius)
    y = verifier.forward(torch.from_numpy(centre)[None]).reshape(-1)
    c, n = int(y.argmax()), y.numel()
    C = torch.zeros(n - 1, n)
    for r, j in enumerate(j for j in range(n) if j != c):
        C[r, c], C[r, j] = 1.0, -1.0
    return {m: verifier.bounds(lo, hi, C=C, method=m)[0].reshape(-1)
            for m in ("ibp", "crown", "alpha-crown")}, verifier


def assert_alpha_beats_crown(tmp_path, names, radius: float = 0.15):
    """CROWN never below IBP, alpha-CROWN never below CROWN, and strictly above it somewhere."""
    better = {}
    for name in names:
        m, _ = zoo_margins(tmp_path, name, radius)
        assert bool((m["crown"] >= m["ibp"]).all()), name
        assert bool((m["alpha-crown"] >= m["crown"]).all()), name
        better[name] = float((m["alpha-crown"] - m["crown"]).max())
    assert all(v > 1e-4 for v in better.values()), better
