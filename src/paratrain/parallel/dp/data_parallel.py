"""Data parallelism: DDP (+ comm hooks, local SGD), ZeRO-1 (ZeroRedundancyOptimizer), and FSDP2 for
ZeRO-2/3 and HSDP (+ bf16 mixed precision, CPU offload). Model-state byte counts live in model_states.py.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import collective

log = logging.getLogger("paratrain")

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
# rank 8: the tiny preset's gradients have a flat spectrum (rank 8 holds ~40% of their energy), rank 4 lags DDP
# by 3% after 300 steps; on a 4096-wide matrix rank 8 still compresses 256x
POWERSGD_RANK = 8


# -- DDP --------------------------------------------------------------------------------------------------
def apply_ddp(model: nn.Module, dp_mesh, device_type: str, bucket_cap_mb: float = 25.0, comm_hook: str = "none",
              local_sgd_period: int = 0, powersgd_start: int = 2) -> nn.Module:
    device_ids = [torch.cuda.current_device()] if device_type == "cuda" else None
    # a model that says some of its parameters may get no gradient in a step (models/hf_model.py) has DDP look
    # for them after each forward (a walk of the autograd graph); otherwise DDP waits for them and fails
    find_unused = bool(getattr(model, "may_leave_parameters_unused", False))
    # grads as views of the reducer's buckets: one copy of the gradients instead of two
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(),
                                  bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
                                  find_unused_parameters=find_unused)
    group = dp_mesh.get_group()
    if comm_hook != "none":
        register_comm_hook(ddp, comm_hook, group, powersgd_start)
    if local_sgd_period:
        attach_local_sgd(ddp, local_sgd_period, group)
    extras = (f", {comm_hook} comm hook" if comm_hook != "none" else "") + \
        (f", local SGD every {local_sgd_period} steps" if local_sgd_period else "") + \
        (", finding parameters without a gradient each step" if find_unused else "")
    log.info("applied DDP over %d ranks%s", dp_mesh.size(), extras)
    return ddp


def register_comm_hook(ddp: DistributedDataParallel, name: str, group, powersgd_start: int = 2) -> None:
    """torch's gradient-compression hooks: fp16 / bf16 casts, or PowerSGD low-rank (with error feedback)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        # plain all-reduce first: early training is the most sensitive to compressed gradients, and DDP
        # rebuilds its buckets after step 1 (the error-feedback buffers need the final shapes): start >= 2
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=max(2, powersgd_start), min_compression_rate=2,
                                            use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise UserError(f"unknown --ddp-comm-hook {name!r}; known: {', '.join(COMM_HOOKS)}")


def attach_local_sgd(ddp: DistributedDataParallel, period: int, group) -> None:
    """Post-local SGD: `period` warm-up steps of ordinary DDP, then each rank steps on its own gradients
    and the parameters are averaged every `period` steps. The trainer calls ddp.after_optimizer_step()."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    state = PostLocalSGDState(process_group=group, subgroup=None, start_localSGD_iter=period,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=period, process_group=group)
    ddp.after_optimizer_step = lambda: averager.average_parameters(ddp.parameters())


# -- ZeRO-1 -----------------------------------------------------------------------------------------------
def _zero_optimizer_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class CheckpointableZero(ZeroRedundancyOptimizer):
        """ZeroRedundancyOptimizer whose state_dict() DCP can save and reshard.

        torch's state_dict() needs consolidate_state_dict() onto one rank first (and pickles states on the
        way). Here state_dict() is collective: every owner broadcasts its parameters' states as tensors,
        so every rank returns the same full state (transiently unsharded) and DCP writes each key once.
        load_state_dict() keeps only the states of the parameters this rank owns now, so a checkpoint loads
        at any world size and into a plain AdamW run too.
        """

        def _broadcast_params_from_rank(self, rank: int):
            """After the step, rank `rank` (in the group) broadcasts the parameters it updated; through the
            collective hooks, so one dropped or late broadcast can be planted (an interceptor's None: none sent)."""
            params = tuple(p for group in self._partition_parameters()[rank] for p in group["params"])
            handles = collective("zero1_params", "dp", "broadcast", self.process_group,
                                 lambda: super(CheckpointableZero, self)._broadcast_params_from_rank(rank),
                                 params, src=rank)
            return [] if handles is None else handles

        def state_dict(self) -> dict:
            import torch.distributed as dist

            params = [p for g in self.param_groups for p in g["params"]]
            keys = zero1_state_keys(self.optim)
            comm_device = params[0].device
            state = {}
            for index, param in enumerate(params):
                owner = self._param_to_rank[param]
                src = dist.get_global_rank(self.process_group, owner)
                local = self.optim.state.get(param) if owner == self.rank else None
                entry = {}
                for key in keys:
                    if local is not None:
                        buf = local[key].detach().to(comm_device).clone()
                    else:
                        buf = (torch.zeros((), dtype=torch.float32, device=comm_device) if key == "step"
                               else torch.empty_like(param))
                    collective("zero1_state", "dp", "broadcast", self.process_group,
                               functools.partial(dist.broadcast, buf, src=src, group=self.process_group), (buf,),
                               src=owner)
                    entry[key] = buf.cpu() if key == "step" else buf
                state[index] = entry
            groups, start = [], 0
            for g in self.param_groups:
                count = len(g["params"])
                groups.append({**{k: v for k, v in g.items() if k != "params"},
                               "params": list(range(start, start + count))})
                start += count
            return {"state": state, "param_groups": groups}

        def load_state_dict(self, state_dict: dict) -> None:
            # keys are ids or FQNs (from DCP); either way they follow the param_groups order, as in torch
            key_to_param = {}
            for saved, live in zip(state_dict["param_groups"], self.param_groups):
                key_to_param.update(zip(saved["params"], live["params"]))
            on_device = bool(self.optim.defaults.get("fused") or self.optim.defaults.get("capturable"))
            for key, value in state_dict["state"].items():
                param = key_to_param.get(key)
                if param is None or value is None or self._param_to_rank[param] != self.rank:
                    continue
                self.optim.state[param] = {
                    k: (v.detach().to(param.device if (v.dim() or on_device) else "cpu").clone()
                        if torch.is_tensor(v) else v) for k, v in value.items()}
            self._sync_param_groups(state_dict["param_groups"], self.param_groups)
            self._sync_param_groups(self.param_groups, self.optim.param_groups)

    return CheckpointableZero


def zero1_state_keys(optim) -> tuple[str, ...]:
    """The per-parameter state the wrapped optimizer keeps, known on every rank (a rank that owns none of a
    parameter's state must still join its broadcast): Adam(W)'s step and two moments; SGD's momentum buffer, or
    nothing without momentum."""
    if isinstance(optim, torch.optim.SGD):
        return ("momentum_buffer",) if optim.defaults["momentum"] else ()
    return ("step", "exp_avg", "exp_avg_sq")


def build_zero1_optimizer(params, optimizer: tuple[type, dict], layout, device_type: str):
    """ZeRO stage 1: the optimizer's states (AdamW's, or --optimizer's) sharded over the data-parallel ranks; DDP
    still all-reduces full grads. `optimizer`: (its class, its constructor's hyperparameters) (train/optim.py)."""
    group = layout.submesh("dp").get_group()
    fused = device_type == "cuda"
    optimizer_class, hyperparameters = optimizer
    opt = _zero_optimizer_class()(params, optimizer_class=optimizer_class, process_group=group, **hyperparameters,
                                  fused=fused or None, foreach=None if fused else True)
    log.info("applied ZeRO-1: optimizer states sharded over %d ranks", layout.dp)
    return opt


# -- FSDP2: ZeRO-2 / ZeRO-3 / HSDP --------------------------------------------------------------------------
def fsdp_mesh(layout):
    """The mesh FSDP runs over: 1-D (shard) for ZeRO-2/3, 2-D (replicate, shard) for HSDP; CP ranks shard too."""
    if not layout.fsdp:
        return None
    if layout.dp_replicate > 1 and not layout.semi_sync:  # --semi-sync: inside each island only
        return layout.mesh["dp_replicate", layout.fsdp_group]
    return layout.mesh[layout.fsdp_group]


def mixed_precision_policy(dtype: str):
    """bf16 compute with fp32 gradient reduction and fp32 sharded master weights; None for fp32/fp16."""
    if dtype not in ("bf16", "fp8"):  # fp8: bf16 parameters around torchao's float8 linears
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, mesh, reshard_after_forward: bool = True, mp_policy=None,
               offload: bool = False) -> nn.Module:
    """fully_shard the embedding, each transformer block, the final norm + head, then the root.

    Works on plain modules and on modules whose parameters are already TP DTensors (FSDP2 composes with
    them). ZeRO-3 reshards the embedding and the blocks after their forward, but not the groups whose forward
    ends it (the norm + head, and the root's own parameters: a transformers model's embedding, norm and head):
    backward starts with them, so resharding would only all-gather them again at once (torchtitan does the same).
    Every group reshards after its backward, so nothing stays unsharded between steps. The planner's memory
    model (dp_memory.py) holds the head's unsharded copy from the loss to the head's backward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    embedding = getattr(model, "tok_embeddings", None)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    # a tied table (the head's weight is the embedding's) must sit in one group: embedding, norm and head together
    tied = embedding is not None and shares_parameters(embedding, head)
    if embedding is not None and not tied:
        fully_shard(embedding, reshard_after_forward=reshard_after_forward, **kwargs)
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or ())
    for block in blocks:
        shard_own_groups(block, reshard_after_forward, kwargs)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    shard_own_groups(model, reshard_after_forward, kwargs)  # those outside the blocks
    if head:
        fully_shard([embedding, *head] if tied else head, reshard_after_forward=False, **kwargs)
    # explicit: since torch 2.8 a root given True reshards too (pytorch#154704); before, FSDP2 kept it gathered
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if not reshard_after_forward:
        track_unsharded_params(model, mesh)
    shape = "x".join(str(s) for s in mesh.shape)
    kind = "HSDP" if mesh.ndim == 2 else ("ZeRO-3" if reshard_after_forward else "ZeRO-2")
    log.info("applied FSDP2 (%s) over mesh %s%s%s", kind, shape,
             ", bf16 params / fp32 reduce" if mp_policy is not None else "", ", CPU offload" if offload else "")
    return model


def shard_own_groups(module: nn.Module, reshard_after_forward: bool, kwargs: dict) -> None:
    """The submodules of `module` that ask for a group apart (`fsdp_own_group`: LoRA's trainable adapters beside a
    frozen base, models/lora.py) sharded as one group: FSDP2 then never mixes trainable and frozen parameters in
    one group, and the frozen groups reduce nothing."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    own = [m for m in module.modules() if getattr(m, "fsdp_own_group", False) and not isinstance(m, FSDPModule)]
    if own:
        fully_shard(own, reshard_after_forward=reshard_after_forward, **kwargs)


def shares_parameters(module: nn.Module, others: list[nn.Module]) -> bool:
    mine = {id(p) for p in module.parameters()}
    return any(id(p) in mine for m in others for p in m.parameters())


_unsharded_bytes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> bytes, its last forward's


def unsharded_bytes_held(module: nn.Module) -> int:
    """The bytes of unsharded parameters `module` held after its last forward (0 unless tracked: ZeRO-2)."""
    return _unsharded_bytes.get(module, 0)


def track_unsharded_params(model: nn.Module, mesh) -> None:
    """Record the bytes of unsharded parameters FSDP keeps from forward to backward (ZeRO-2), per step."""
    from torch.distributed.tensor import DTensor

    shard_dims = set(mesh.mesh_dim_names or ())

    def is_fsdp_shard(p) -> bool:
        return isinstance(p, DTensor) and bool(shard_dims & set(p.device_mesh.mesh_dim_names or ()))

    def record(module, args, output):
        local = (p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if not is_fsdp_shard(p))
        _unsharded_bytes[module] = sum(t.numel() * t.element_size() for t in local)

    model.register_forward_hook(record)


def apply_data_parallel(model: nn.Module, layout) -> nn.Module:
    """The last step of parallelize(): FSDP2 when the layout shards, else DDP over the replicas (and CP ranks);
    under --semi-sync the same inside each island only (parallel/semi_sync/)."""
    if layout.fsdp:
        return apply_fsdp(model, fsdp_mesh(layout), reshard_after_forward=layout.zero_stage != 2,
                          mp_policy=mixed_precision_policy(layout.dtype), offload=layout.cpu_offload)
    if layout.ddp:
        # cp ranks hold replicated parameters unless FSDP shards over dp_shard_cp, so DDP averages over dp_cp
        # (--semi-sync: over an island's cp ranks alone; Layout.ddp is then true only with cp > 1)
        mesh = layout.submesh("cp" if layout.semi_sync else "dp_cp")
        return apply_ddp(model, mesh, mesh.device_type, comm_hook=layout.ddp_comm_hook,
                         local_sgd_period=layout.local_sgd_period, powersgd_start=layout.powersgd_start)
    return model
