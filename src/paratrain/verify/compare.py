"""verify's comparisons: one step of the parallel run (every rank's record) against the single-device reference,
tolerances (fp32 constants checked against measured margins, or a multiple of the run's own low-precision noise
floor), and the first-divergence report. NaN never passes: every check is `error <= bound`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# bf16/fp16: the parallel run may differ from the same-precision single-device reference by this many noise floors
# (the floor: that reference against the fp32 one). FSDP2's bf16 policy casts EVERY parameter (norms, embedding) to
# bf16 where autocast keeps norms and reductions in fp32: measured up to 8.6x the autocast floor, so it gets 16.
FLOOR_MULTIPLE = 4.0
FSDP_BF16_FLOOR_MULTIPLE = 16.0


def floor_multiple(layout) -> float:
    return FSDP_BF16_FLOOR_MULTIPLE if layout.fsdp and layout.dtype == "bf16" else FLOOR_MULTIPLE


@dataclass(frozen=True)
class Tolerance:
    loss_atol: float = 1e-6  # loss: |l - l_ref| <= loss_atol + loss_rtol * |l_ref|
    loss_rtol: float = 1e-5
    param_atol: float = 1e-9  # per tensor: ||p - p_ref|| <= param_rtol * ||this step's reference update|| + atol
    param_rtol: float = 1e-2
    grad_rtol: float = 1e-4  # per tensor: ||g - g_ref|| <= grad_rtol * ||g_ref|| (before clipping)
    grad_norm_rtol: float = 1e-5  # the global pre-clip norm, relative
    act_rtol: float = 1e-5  # activation fingerprints (sums over the global batch), relative
    basis: str = "fp32 constants"

    @classmethod
    def for_dtype(cls, dtype: str = "fp32", *_unused) -> Tolerance:
        """fp32's fixed bounds; low precision gets its bounds from the measured noise floor (from_floor)."""
        return cls()

    @classmethod
    def from_floor(cls, floor: dict, multiple: float = FLOOR_MULTIPLE, basis: str = "noise floor") -> Tolerance:
        """multiple x the floor of each metric, never tighter than fp32's bound."""
        base = cls()
        pick = {f: max(getattr(base, f), multiple * floor[k]) for f, k in
                (("loss_rtol", "loss"), ("grad_rtol", "grad"), ("grad_norm_rtol", "grad_norm"),
                 ("param_rtol", "param"), ("act_rtol", "act"))}
        return cls(loss_atol=base.loss_atol, param_atol=base.param_atol, basis=f"{multiple:g} x {basis}", **pick)

    def to_dict(self) -> dict:
        return asdict(self)


def nanmax(values, start: float = 0.0) -> float:
    """max that returns NaN as soon as one value is NaN (the builtin max(x, nan) returns x)."""
    out = start
    for v in values:
        if v != v:
            return float("nan")
        out = max(out, v)
    return out


def _ratio(num: float, den: float) -> float:
    if num != num or den != den:
        return float("nan")
    if num == 0.0:
        return 0.0
    return num / den if den > 0 else float("inf")


def grad_errors(ref: dict, got: dict) -> dict[str, tuple[float, float]]:
    """{name: (||g - g_ref|| / ||g_ref||, <g, g_ref> / <g_ref, g_ref>)} for the tensors this rank holds."""
    out = {}
    for name, g in got.items():
        r = ref.get(name)
        if r is None or r.shape != g.shape:
            out[name] = (float("inf"), float("nan"))
            continue
        rr = float((r.double() * r.double()).sum())
        scale = float((g.double() * r.double()).sum()) / rr if rr > 0 else float("nan")
        out[name] = (_ratio(float((g - r).double().norm()), math.sqrt(rr)), scale)
    return out


def param_errors(ref: dict, update: dict, got: dict, set_aside: dict | None = None) -> dict[str, tuple[float, float]]:
    """{name: (||p - p_ref|| / ||this step's reference update||, max |p - p_ref|)} for this rank's tensors, over
    the elements not set aside (`set_aside`: {name: bool mask}, rounding_elements)."""
    out = {}
    for name, p in got.items():
        r = ref.get(name)
        if r is None or r.shape != p.shape:
            out[name] = (float("inf"), float("inf"))
            continue
        diff = (p - r).double()
        mask = (set_aside or {}).get(name)
        if mask is not None:
            diff = diff.masked_fill(mask, 0.0)
        out[name] = (_ratio(float(diff.norm()), update[name]), float(diff.abs().max()) if diff.numel() else 0.0)
    return out


def rounding_elements(ref_grad, grad, rel: float, grad_rtol: float):
    """The elements of one tensor whose gradient is rounding, as a bool mask (None: none): the tensor's gradient
    passed its check (rel <= grad_rtol) and the two runs disagree on the element by more than half its reference
    value, so it lies below what the gradient check resolves (|g_ref,i| < 2·grad_rtol·||g_ref||) and its sign is
    the summation order's. An optimizer that scales each element by its own history (Adam: m / (sqrt(v) + eps))
    moves such an element by up to about lr, either way: its parameter is decided by rounding, not by the layout.
    Elements whose gradient is exactly 0 in both runs stay compared (nothing should move them but weight decay)."""
    if not rel <= grad_rtol:  # also a name or shape the reference lacks (rel inf)
        return None
    mask = (grad - ref_grad).abs() > 0.5 * ref_grad.abs()
    return mask if bool(mask.any()) else None


def set_aside_summary(set_aside: dict) -> dict:
    """What the parameter comparison left out (rounding_elements): the elements over all ranks, and the three
    tensors with the most."""
    rows = sorted(({"name": name, "rank": rank, "elements": int(mask.sum()), "of": mask.numel()}
                   for (rank, name), mask in set_aside.items()), key=lambda row: -row["elements"])
    return {"elements": sum(row["elements"] for row in rows), "largest": rows[:3]}


def combine_fingerprints(per_rank: list[dict | None]) -> dict[str, list[float]] | None:
    """Add up the ranks' (numel, sum, sumsq, sum|x|) per module: each rank sent only the part it alone holds."""
    if any(acts is None for acts in per_rank):
        return None
    total: dict[str, list[float]] = {}
    for acts in per_rank:
        for path, stats in acts.items():
            total[path] = [a + b for a, b in zip(total.get(path, [0.0] * 4), stats)]
    return total


def fingerprint_error(ref: list[float], got: list[float] | None) -> float:
    if got is None or got[0] != ref[0]:
        return float("inf")
    scale = ref[3]  # sum |x|: the scale of the sum; sum of squares compares with itself
    return nanmax([_ratio(abs(got[1] - ref[1]), scale), _ratio(abs(got[2] - ref[2]), ref[2]),
                   _ratio(abs(got[3] - ref[3]), scale)])


def compare_step(ref: dict, records: list[dict], set_aside: dict | None = None, grad_rtol: float = 0.0) -> dict:
    """Errors of one step: every rank's record against the reference step.

    ref: {"loss", "grad_norm", "grads", "params", "update", "acts"}; records[r]: the same keys from rank r.
    set_aside: {(rank, name): bool mask}, kept by the caller across steps: the parameter elements whose gradient
    was rounding at this or an earlier step (rounding_elements, judged with grad_rtol), left out of the parameter
    comparison from then on (None: every element compared).
    """
    grads, params, loss, norm = [], [], [], []
    for rank, rec in enumerate(records):
        loss.append(abs(rec["loss"] - ref["loss"]))
        norm.append(_ratio(abs(rec["grad_norm"] - ref["grad_norm"]), abs(ref["grad_norm"])))
        errors = grad_errors(ref["grads"], rec["grads"])
        grads += [(rel, name, rank, scale) for name, (rel, scale) in errors.items()]
        masks = None
        if set_aside is not None:
            for name, (rel, _) in errors.items():
                mask = rounding_elements(ref["grads"].get(name), rec["grads"][name], rel, grad_rtol)
                if mask is not None:
                    old = set_aside.get((rank, name))
                    set_aside[(rank, name)] = mask if old is None else old | mask
            masks = {name: m for (r, name), m in set_aside.items() if r == rank}
        params += [(rel, name, rank, mx) for name, (rel, mx) in
                   param_errors(ref["params"], ref["update"], rec["params"], masks).items()]
    held_grads = set().union(*(rec["grads"] for rec in records))
    held_params = set().union(*(rec["params"] for rec in records))
    acts = None
    combined = combine_fingerprints([rec.get("acts") for rec in records])
    if ref.get("acts") is not None and combined is not None:
        acts = [(fingerprint_error(stats, combined.get(path)), path) for path, stats in ref["acts"].items()]
    return {"loss_abs": nanmax(loss), "grad_norm_rel": nanmax(norm), "grads": grads, "params": params, "acts": acts,
            "missing": sorted((set(ref["grads"]) - held_grads) | (set(ref["params"]) - held_params))}


def largest_first(entries: list[tuple]) -> list[tuple]:
    return sorted(entries, key=lambda e: math.inf if e[0] != e[0] else e[0], reverse=True)


def judge(err: dict, ref: dict, tol: Tolerance) -> dict:
    """Which checks this step passes (NaN fails every one)."""
    loss_ok = err["loss_abs"] <= tol.loss_atol + tol.loss_rtol * abs(ref["loss"])
    acts_ok = err["acts"] is None or all(e <= tol.act_rtol for e, _ in err["acts"])
    grads_ok = err["grad_norm_rel"] <= tol.grad_norm_rtol and all(e[0] <= tol.grad_rtol for e in err["grads"])
    params_ok = all(e[0] <= tol.param_rtol + tol.param_atol / max(ref["update"].get(e[1], 0.0), 1e-30)
                    for e in err["params"])
    return {"loss": bool(loss_ok), "activations": bool(acts_ok), "grads": bool(grads_ok) and not err["missing"],
            "params": bool(params_ok) and not err["missing"]}


def divergence(step: int, err: dict, ok: dict, tol: Tolerance, order: list[str]) -> dict:
    """Where step `step` diverges first: what differs, the first module, the parameters by largest error."""
    differs = next(k for k in ("loss", "activations", "grads", "global_params", "params") if not ok.get(k, True))
    module, module_error = None, None
    if err["acts"] is not None:
        bad = {path: e for e, path in err["acts"] if not e <= tol.act_rtol}
        module = next((path for path in order if path in bad), None)
        module_error = bad.get(module)
    if differs in ("params", "global_params"):  # global_params: --semi-sync's global copies (semi_sync_parity.py)
        entries, bound = err["params" if differs == "params" else "global"], tol.param_rtol
        worst = [{"name": n, "rank": r, "rel_error": e, "max_abs_diff": mx} for e, n, r, mx in
                 largest_first(entries)[:3]]
    else:
        entries, bound = err["grads"], tol.grad_rtol
        worst = [{"name": n, "rank": r, "rel_error": e, "grad_scale": s} for e, n, r, s in
                 largest_first(entries)[:3]]
    ranks = sorted({e[2] for e in entries if not e[0] <= bound})
    return {"step": step, "differs": differs, "loss_differs": not ok["loss"], "activations_differ": not ok["activations"],
            "grads_differ": not ok["grads"], "params_differ": not ok["params"], "module": module,
            "module_rel_error": module_error,
            "parameters": worst, "ranks": ranks, "missing": err["missing"]}
