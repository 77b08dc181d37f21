"""The Python API: train any nn.Module under any data-parallel strategy (and tp with a plan), from a script.

    import paratrain
    summary = paratrain.fit(build, data, loss_fn=loss_fn, strategy="zero3", nproc=2, steps=100)

See docs/api.md. Under torchrun/srun each rank runs fit() itself; otherwise fit() starts `nproc` local
processes (torch elastic, as `paratrain train` does) and returns rank 0's summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from paratrain.errors import UserError

RUNTIME_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def fit(model_fn: Callable | str, data: Callable | str | None = None, *, loss_fn: Callable | None = None,
        tp_plan=None, strategy: str = "ddp", **config) -> dict | None:
    """Train `model_fn()` and return the run summary (rank 0; None on other ranks under torchrun).

    model_fn: a module-level function returning an nn.Module (each rank calls it after seeding torch with
      `seed`, so all start from the same weights), or "FILE.py:FUNCTION" (the file's optional `loss_fn`,
      `data` and `tp_plan` are used too, unless given here).
    data: a module-level function `data(indices: np.ndarray) -> (inputs, targets)`, a pure function of the
      sample indices; or a paratrain data spec ("synthetic", a token file, documents with `tokenizer=`) with
      `vocab_size=` for an LM; or a torch Dataset / IterableDataset (`data_workers=N`), sharded across the
      data-parallel ranks by paratrain (docs/data.md); or an object implementing the Source protocol of
      paratrain/train/data/source.py.
    loss_fn: `loss_fn(outputs, targets) -> scalar`; default: next-token cross entropy on (batch, seq, vocab).
    tp_plan: for strategy "tp": {module path: ParallelStyle}, or a function of the model returning one.
    config: any `paratrain train` setting by its config name: nproc, steps, global_batch, lr, seed, out,
      ckpt_dir, ckpt_every, resume, dtype, device, degrees (dp_shard=2, ...), ...
    Functions must be importable by name (defined at module level), since each rank is its own process.
    """
    from paratrain.config import load_config
    from paratrain.train.custom import CustomModel, check_custom_run, load_script
    from paratrain.train.launch import run_workers
    from paratrain.train.runtime import in_launched_process
    from paratrain.train.validate import world_size_for
    from paratrain.train.worker import train_worker

    if isinstance(model_fn, str):
        custom = load_script(model_fn)
        if loss_fn is not None or data is not None or tp_plan is not None:
            custom = CustomModel(custom.build, loss_fn or custom.loss_fn, data if data is not None else custom.data,
                                 tp_plan if tp_plan is not None else custom.tp_plan, custom.name)
    elif callable(model_fn):
        custom = CustomModel(model_fn, loss_fn, data, tp_plan, name=f"{getattr(model_fn, '__module__', '')}.{getattr(model_fn, '__qualname__', 'custom')}")
    else:
        raise UserError(f"model_fn must be a function or 'FILE.py:FUNCTION', not {type(model_fn).__name__}")
    config.setdefault("metrics", config.get("out") is not None)
    config.setdefault("resume", "never")
    cfg = load_config(None, {"strategy": strategy, **config})
    launched = in_launched_process()
    world = world_size_for(cfg)
    check_custom_run(cfg, world, custom)
    if cfg.out:
        from pathlib import Path

        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    # a script path travels as its spec (each rank imports the file); functions travel pickled by name
    as_script = isinstance(model_fn, str) and loss_fn is None and data is None and tp_plan is None
    payload = model_fn if as_script else custom
    # a lone run happens in this process and marks it as a rank (RANK, WORLD_SIZE, ...): undo that afterwards,
    # so that a later fit() launches its own processes again
    saved = {k: os.environ.get(k) for k in RUNTIME_ENV}
    try:
        results = run_workers(train_worker, (cfg.model_dump(), cfg.out, False, payload), world, cfg.max_restarts,
                              cfg.timeout_s)
    finally:
        if not launched:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return results.get(0)
