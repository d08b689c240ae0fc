"""The oscar-aqua preset with the arithmetic of studies/aqua_cache.py's simulation, scored by ``rotkv eval``.

rotkv's preset (rotkv.cache.predict) applies the inter-layer key maps in float32 on the previous layer's
un-RoPE'd keys. The simulation applied them in float64 on the previous layer's post-RoPE float32 keys
(unRoPE, map, RoPE in float64, then rounded to float32), and placed the exact keys, not the residual, in the
refine tier's buckets of prediction plus decoded residual. Both are the same prediction up to float rounding, but
the prediction chain amplifies a rounding difference: one element that rounds to the next 2-bit code in layer
``l - 1`` moves the prediction of every element of that token in layer ``l``, whose codes then move too, and so
on up the layers. This script patches, in its own process, :class:`rotkv.cache.predict.KeyPredictor` to the
simulation's arithmetic (``--arith study``) or to a third rounding, float32 with the map applied to the two halves
of the input apart (``--arith split``), then runs ``rotkv eval`` with the arguments after ``--``: the first gives
the simulation's results bit for bit with the real cache (predictions recomputed from the previous layer's pages,
nothing stored beside them), the second another realization of the same format to measure the rounding noise.

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/aqua_preset_arith.py --arith study -- --suite mixed --split test \
        --profile full --lengths 2048 --windows 2 --new-tokens 64 --threads 1 --methods oscar-aqua \
        --artifact-dir artifacts --out docs/results/aqua-preset/test-study-arith
"""
import argparse
import sys

import torch

from rotkv.cache import predict as P
from rotkv.cache.refine import RefineRings

p = argparse.ArgumentParser()
p.add_argument("--arith", choices=("study", "split"), required=True)
p.add_argument("eval_args", nargs=argparse.REMAINDER, help="after --: the rotkv eval arguments")
args = p.parse_args()
eval_args = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args


def study_predict(self, ids, trig):
    """The simulation's ``apply_map``: float64 unRoPE, map and RoPE of the previous layer's post-RoPE keys."""
    if self.A is None:
        return None
    prev = self.chain.previous(self.layer)[ids].double()
    cos, sin = (t.double() for t in trig)
    n, h, pg, d = prev.shape
    x = P.unrope(prev, cos, sin).permute(0, 2, 1, 3).reshape(n * pg, h * d)
    x = torch.cat([x, torch.ones(n * pg, 1, dtype=x.dtype, device=x.device)], -1)
    pre = (x @ self.A.double()).reshape(n, pg, h, d).permute(0, 2, 1, 3)
    return P.rope(pre, cos, sin).float()


def study_leave(self, ids, pred, decoded, trig, capacity):
    """The simulation's reconstruction ``(pred R_K + decoded) R_K^T + mu``, kept post-RoPE (``study_predict``)."""
    recon = decoded if pred is None else self._rotate(pred) + decoded
    k = torch.einsum("nhpe,hde->nhpd", recon, self.R) + self.mu[None, :, None]
    self.chain.leave(self.layer, ids, k, capacity)


_STASH: dict = {}  # the exact keys and the rotated prediction of the flush in progress (``--arith study``)
_residual, _ring_write = P.KeyPredictor.residual, RefineRings.write


def study_residual(self, x, ids, index):
    """The residual as rotkv makes it; the exact keys and the prediction kept for :func:`study_ring_write`."""
    res, state = _residual(self, x, ids, index)
    _STASH["exact"], _STASH["pred"] = x, (None if state[0] is None else self._rotate(state[0]))
    return res, state


def study_ring_write(self, side, x, dst, stored, parts, codec, target):
    """The simulation's refine codes: the exact keys placed in the bucket of ``prediction + decoded residual``
    (rotkv places the residual in the bucket of the decoded residual: the same codes up to rounding)."""
    if side != 0 or self.keys is None or "exact" not in _STASH:
        return _ring_write(self, side, x, dst, stored, parts, codec, target)
    exact, pred = _STASH.pop("exact"), _STASH.pop("pred")
    rows, index, sel = target
    pick = (lambda t: t) if sel is None else (lambda t: t[sel])  # noqa: E731
    st = {name: pick(t) for name, t in stored.items()}
    base = codec.decode(st) + (0 if pred is None else pick(pred))
    self.keys.write(pick(exact), base, st["scale"], rows, index)


def split_predict(self, ids, trig):
    """float32, the map's input in two halves summed apart: another rounding of the same prediction."""
    if self.A is None:
        return None
    prev = self.chain.previous(self.layer)[ids]
    n, h, pg, d = prev.shape
    x = prev.permute(0, 2, 1, 3).reshape(n * pg, h * d)
    half = x.shape[1] // 2
    pre = (x[:, half:] @ self.A[half:-1] + self.A[-1]) + x[:, :half] @ self.A[:half]
    return P.rope(pre.reshape(n, pg, h, d).permute(0, 2, 1, 3), *trig)


def main():
    if args.arith == "study":
        P.KeyPredictor.predict, P.KeyPredictor._leave = study_predict, study_leave
        P.KeyPredictor.residual, RefineRings.write = study_residual, study_ring_write
    else:
        P.KeyPredictor.predict = split_predict
    from rotkv.cli import main as cli_main

    sys.exit(cli_main(["eval", *eval_args]))


if __name__ == "__main__":
    main()
