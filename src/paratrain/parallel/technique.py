"""What one parallel technique brings to its dimension (dims.py `Dim.technique`): its check, its apply and its
planner cost terms, as one object whose methods the registry's users call in turn. Each technique's subclass
lives in its own package (dp/, tp/, pp/, cp/, ep/) next to the code it applies.

The defaults are "nothing to do", so a technique overrides only what it has. Importing this, or a technique's
own module, imports no torch: `plan` answered from its cache reads the registry without it; methods import
torch-using code when called.

The planner's cost methods take `p`, the step being priced (plan/costing/time.py `StepPricing`): the hardware
profile, the model's args, the Layout, the sequence length and dtype, the step's estimate (`p.est`, which
counts the bytes), and the placement of a group (`p.where(group)`, `p.rails(group)`).
"""

from __future__ import annotations


class Technique:
    # place in parallelize()'s order (DESIGN.md: pipeline split -> TP/SP -> CP -> EP -> AC -> compile ->
    # FSDP/DDP); None: not applied there (the pipeline split is made by the caller, per stage)
    apply_order: float | None = None
    # the error-bar family of a layout this technique shapes (plan/error_bars.py) and its precedence: the
    # highest-ranked family among a layout's enabled techniques names it
    family: str = ""
    family_rank: int = 0
    composes_step = False  # this technique sets how the step's parts add up (the pipeline)

    def enabled(self, layout) -> bool:
        """Whether `layout` uses this technique (its degree > 1)."""
        return False

    def family_of(self, layout) -> str:
        """The error-bar family this technique gives `layout` ("" when it does not shape it)."""
        return self.family if self.enabled(layout) else ""

    def check(self, args, layout, seq_len: int | None = None) -> None:
        """UserError if the model cannot be split this way (called when enabled)."""

    def apply(self, model, layout, tp_plan: dict | None = None):
        """The model with this technique applied on this rank (called by parallelize() when enabled)."""
        return model

    def breaks_compiled_graph(self, model, layout) -> bool:
        """Whether this technique's code cannot be traced whole by torch.compile (dynamo compiles around it)."""
        return False

    # -- the search ----------------------------------------------------------------------------------------------
    def searched_degree(self, args, degree: int) -> bool:
        """For a dimension `within` others: whether the search tries `degree` when the user left it open."""
        return degree == 1

    def allows_sp(self, layout_degree: int) -> bool:
        """Whether sequence parallelism can run beside this technique at this degree."""
        return True

    # -- the step-time estimate ------------------------------------------------------------------------------------
    def adjust_chunk(self, p, chunk) -> None:
        """Change one priced model chunk's times in place (async TP hides its collectives under the matmuls)."""

    def optimizer_share(self, layout, seconds: float) -> float:
        """The optimizer step's seconds on one rank, of `seconds` for the rank's whole model part."""
        return seconds

    def step_cost(self, p, ranks: dict, busy: float) -> dict[str, float]:
        """Exposed seconds this technique adds to one step, by breakdown key (`plan --json`'s
        time_breakdown_s); `ranks`: every pipeline stage rank's priced chunks, `busy`: the micro-batch slots."""
        return {}
