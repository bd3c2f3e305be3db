"""pwl: the exact minimum of a convex piecewise-linear cost of the two placement fractions over a polygon.

The cost is ``sum_i w_i * max_j (c_ij + a_ij x + b_ij y)`` and the feasible set is ``0 <= x, y <= 1`` plus
linear constraints ``c + a x + b y <= 0`` (memory limits). A convex piecewise-linear function on a polygon
attains its minimum at a vertex of the arrangement formed by the constraint lines and the creases where
two pieces of one max are equal, so enumerating the pairwise intersections of those lines is exact. This
replaces a general LP solver for the few dozen lines the policy search produces.
"""

from __future__ import annotations

import functools

import numpy as np

from .cost_model import Lin

_EPS = 1e-12
_FEASIBLE = 1e-9  # constraints are normalised (memory / limit - 1), so this is relative


@functools.lru_cache(maxsize=256)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (i, j), i < j, of every pair of ``n`` lines (numpy builds them anew per call: a tenth of a search)."""
    i, j = np.triu_indices(n, k=1)
    i.flags.writeable = j.flags.writeable = False  # shared between calls
    return i, j


def _coefficients(lins: list[Lin]) -> np.ndarray:
    return np.array([[p.c, p.cx, p.cy] for p in lins], dtype=float).reshape(-1, 3)


def _prune(pieces: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """Drop pieces that another piece bounds from above on every corner of the box (hence everywhere on it);
    of identical pieces the first stays."""
    values = pieces[:, :1] + pieces[:, 1:2] * corners[:, 0] + pieces[:, 2:3] * corners[:, 1]  # [pieces, corners]
    above = (values[:, None, :] >= values[None, :, :] - 1e-15).all(-1)  # [j, i]: j >= i everywhere
    strictly = (values[:, None, :] > values[None, :, :]).any(-1)
    earlier = np.arange(len(pieces))[:, None] < np.arange(len(pieces))[None, :]
    dominated = (above & (strictly | earlier)).any(axis=0)
    return pieces[~dominated]


def _corners(fix_y: bool) -> np.ndarray:
    y_hi = 0.0 if fix_y else 1.0
    return np.array([[0, 0], [1, 0], [0, y_hi], [1, y_hi]], dtype=float)


def pruned(pieces: list[Lin], fix_y: bool = False) -> np.ndarray:
    """One group's pieces as :func:`minimize` uses them: a caller that minimises the same group under several
    constraints passes this instead of the list, and prunes it once."""
    return _prune(_coefficients(pieces), _corners(fix_y))


def minimize(groups: list[tuple[float, list[Lin] | np.ndarray]], constraints: list[Lin], fix_y: bool = False,
             tiebreak: Lin | None = None) -> tuple[float, float, float] | None:
    """(x, y, cost) at the minimum, ``None`` when no point satisfies the constraints. ``fix_y`` pins y = 0.
    A group's pieces may come :func:`pruned` with the same ``fix_y``. Among equal costs the smallest ``tiebreak``
    wins (then the smallest x, then y)."""
    y_hi = 0.0 if fix_y else 1.0
    corners = _corners(fix_y)
    weights = np.array([w for w, _ in groups], dtype=float)
    pieces = [ps if isinstance(ps, np.ndarray) else _prune(_coefficients(ps), corners) for _, ps in groups]
    cons = _coefficients(constraints)
    lines = [cons]
    for p in pieces:  # creases: p_i - p_j = 0
        i, j = _pairs(len(p))
        lines.append(p[i] - p[j])
    lines.append(np.array([[0, 1, 0], [-1, 1, 0], [0, 0, 1], [-y_hi, 0, 1]], dtype=float))  # x=0, x=1, y=0, y=y_hi
    lines = np.concatenate(lines)
    scale = np.abs(lines).max(axis=1, keepdims=True)
    lines = lines[scale[:, 0] > _EPS] / scale[scale[:, 0] > _EPS]

    if fix_y:
        usable = np.abs(lines[:, 1]) > _EPS
        xs = np.concatenate([-lines[usable, 0] / lines[usable, 1], [0.0, 1.0]])
        points = np.stack([xs, np.zeros_like(xs)], axis=1)
    else:
        i, j = _pairs(len(lines))
        c1, a1, b1 = lines[i].T
        c2, a2, b2 = lines[j].T
        det = a1 * b2 - a2 * b1
        ok = np.abs(det) > _EPS
        xs = (-c1[ok] * b2[ok] + c2[ok] * b1[ok]) / det[ok]
        ys = (-a1[ok] * c2[ok] + a2[ok] * c1[ok]) / det[ok]
        points = np.concatenate([np.stack([xs, ys], axis=1), corners])
    inside = np.all((points >= -_FEASIBLE) & (points <= np.array([1.0, y_hi]) + _FEASIBLE), axis=1)
    points = np.clip(points[inside], 0.0, [1.0, y_hi])
    if len(cons):
        slack = cons[:, :1].T + points[:, :1] * cons[:, 1] + points[:, 1:2] * cons[:, 2]
        points = points[np.all(slack <= _FEASIBLE, axis=1)]
    if not len(points):
        return None
    cost = np.zeros(len(points))
    for w, p in zip(weights, pieces):
        cost += w * (p[:, 0][None] + points[:, :1] * p[:, 1][None] + points[:, 1:2] * p[:, 2][None]).max(axis=1)
    best = cost.min()
    near = np.flatnonzero(cost <= best + 1e-9 * abs(best) + 1e-15)
    key = [(tiebreak.at(*points[k]) if tiebreak is not None else 0.0, points[k][0], points[k][1]) for k in near]
    k = near[min(range(len(near)), key=key.__getitem__)]
    return float(points[k][0]), float(points[k][1]), float(cost[k])
