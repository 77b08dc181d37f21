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

    # the order the search varies the techniques' options in (search_options), outermost first: it decides
    # between equally fast layouts, so it stays as it was (ZeRO stage, SP, CP flavour, pipeline schedule)
    search_order: int = 0

    def worth_searching(self, degree: int, seq_len: int) -> bool:
        """For a world-size factor the user left open: whether the search tries `degree` at this sequence length."""
        return True

    def search_options(self, degrees: dict[str, int], fixed: dict, dims: tuple) -> list[dict]:
        """The settings of this technique's Layout options the search tries at these degrees (each a dict of
        Layout fields), given what the user fixed (`fixed`: plan's options, None when left open) and every
        declared dimension (`dims`, dims.py `all_dims()`)."""
        return [{}]

    def deferred_in_search(self, layout, fixed: dict, nodes: int) -> bool:
        """Whether the search tries `layout` only when no other layout fits (or in `plan --search full`)."""
        return False

    def allows_microbatches(self, layout, microbatches: int) -> bool:
        """Whether this technique runs `layout` with that many micro-batches per step."""
        return True

    def frugal_options(self, degrees: dict[str, int]) -> dict:
        """Layout fields that hold the least memory at these degrees (the smallest GPU count that fits)."""
        return {}

    # -- the memory estimate -------------------------------------------------------------------------------------
    def kept_gradients(self, tr, args, layout) -> tuple | None:
        """((unit, share), ...): the share of each model unit's traced gradients ("pre", "block", "head") one rank
        keeps once that unit's backward is done (FSDP reduce-scatters them then); None: this technique keeps
        them whole. `tr`: the part's trace (plan/costing/compose.py Composed)."""
        return None

    def shard_states(self, s, tr, args, layout, part: str, layers: int, dtype: str, notes: list[str]) -> None:
        """Change one rank's states of one model part in place as this technique's wrapper holds them (data
        parallelism's sharding and buffers). `s` (plan/costing/memory.py RankStates): params, optimizer, grads,
        opt_rest, grads_live, extra, acts (bytes), fb (the traced forward/backward peak) and kept (the gradient
        shares fb was walked with: kept_gradients); `tr`: the part's trace."""

    # -- plan's reasons ------------------------------------------------------------------------------------------
    def reasons(self, r) -> list[str]:
        """Plain-language lines on what this technique costs or buys in a planned layout (`plan --json`'s
        reasons). `r` (plan/plan_report.py ReasonContext): the layout, the GPU, the sequence length, the usable
        bytes per GPU, `r.states(layout)` (model-state bytes per rank) and `r.gib(bytes)` (a size as text)."""
        return []

    def step_reasons(self, r) -> list[str]:
        """The same, on the priced step (`r.time`, plan/costing/time.py TimeEstimate); asked outermost dim first."""
        return []

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

    # -- generation (`plan --inference`, plan/inference_cost.py) ---------------------------------------------------
    # what this technique's degree does to generation: "heads" (each layer's heads and matrices split), "stages"
    # (the layers split into stages a token passes in turn), "replicas" (whole copies, each with its own rows)
    inference_role: str = ""

    def inference_problem(self, args, degree: int) -> str | None:
        """Why the model cannot be split `degree` ways for generation (None: it can)."""
        return None

    def inference_comm_s(self, args, degree: int, rows: int, act_bytes: int, link: tuple[float, float]) -> float:
        """Seconds of this technique's communication in one forward of `rows` tokens (one a row when decoding);
        `link`: (bytes per second, seconds per hop)."""
        return 0.0
