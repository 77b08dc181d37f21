"""Context parallelism (--cp, ring or Ulysses) as the registry holds it: its check, its apply, and its exposed
communication per micro-batch."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.options import CP_IMPLS
from paratrain.parallel.technique import Technique

CP_MIN_SEQ = 8192  # context parallelism is searched from this sequence length up (or when --cp is given)


def check_cp(args, layout, seq_len: int | None = None) -> None:
    """The model must be context-parallel as asked: sequence cut into 2*cp chunks, Ulysses splits heads."""
    if layout.cp <= 1:
        return
    if layout.cp_impl not in CP_IMPLS:
        raise UserError(f"unknown --cp-impl {layout.cp_impl!r}; choose one of {', '.join(CP_IMPLS)}")
    if seq_len is not None and seq_len % (2 * layout.cp):
        raise UserError(f"cp={layout.cp} needs the sequence length ({seq_len}) to be a multiple of 2*cp={2 * layout.cp}")
    if layout.cp_impl == "ulysses":
        from paratrain.parallel.cp.ulysses import check_ulysses_heads

        check_ulysses_heads(args.n_heads // layout.tp, layout.cp)


class ContextParallel(Technique):
    apply_order = 20
    family, family_rank = "context-parallel", 40

    def enabled(self, layout) -> bool:
        return layout.cp > 1

    def check(self, args, layout, seq_len: int | None = None) -> None:
        check_cp(args, layout, seq_len)

    def apply(self, model, layout, tp_plan: dict | None = None):
        if not self.enabled(layout):
            return model
        from paratrain.parallel.cp.context_parallel import apply_cp

        return apply_cp(model, layout.submesh("cp"), impl=layout.cp_impl)

    def breaks_compiled_graph(self, model, layout) -> bool:
        return self.enabled(layout) and layout.cp_impl == "ring"  # ring attention's P2P sends cannot be traced

    search_order = 2

    def worth_searching(self, degree: int, seq_len: int) -> bool:
        return degree == 1 or seq_len >= CP_MIN_SEQ

    def search_options(self, degrees: dict[str, int], fixed: dict, dims: tuple) -> list[dict]:
        if degrees["cp"] == 1:
            return [{"cp_impl": CP_IMPLS[0]}]
        return [{"cp_impl": impl} for impl in CP_IMPLS if not fixed.get("cp_impl") or impl == fixed["cp_impl"]]

    def deferred_in_search(self, layout, fixed: dict, nodes: int) -> bool:
        # the search tries it for long sequences only when nothing else fits, unless --cp is given
        return self.enabled(layout) and not (fixed.get("cp") or 1) > 1

    def reasons(self, r) -> list[str]:
        lay = r.layout
        if not self.enabled(lay):
            return []
        return [f"CP ({lay.cp_impl}) splits each {r.seq_len}-token sequence {lay.cp} ways: activations / {lay.cp}"]

    def adjust_chunk(self, p, chunk) -> None:
        # ring's K/V rotation is posted before each block's attention and hides under it; Ulysses' all-to-alls
        # are exposed; the calls' own cost never hides
        per_mb = chunk.fwd + chunk.bwd
        chunk.cp_exposed = chunk.cp_calls + (max(0.0, chunk.cp_comm - p.profile.overlap * 0.5 * per_mb)
                                             if p.layout.cp_impl == "ring" else chunk.cp_comm)


CONTEXT_PARALLEL = ContextParallel()
