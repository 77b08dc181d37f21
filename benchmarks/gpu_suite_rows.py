"""The GPU suite's rows, most valuable first, and the command line each one runs (benchmarks/gpu_suite.py).

A row is one child process: `paratrain train/verify/doctor/plan --calibrate`, or the hand-written loop of
benchmarks/mfu.py (benchmarks/gpu_suite_plain.py). `--dry-run` turns every row into its CPU twin (a tiny
model of the same family, seq 64, micro-batch 2, fp32, eager, a few steps) and leaves the command otherwise
as the GPU runs it, the row's speed flags included.

First come issue 47's rows: gpt2-124m compiled bf16 at micro-batch 16, then each speed flag alone on top of it,
then all of them; micro-batch 32 without and with all of them; then FP8 where it should pay, on Llama 3 8B's
shape cut to 4 blocks (micro-batch 2 x seq 4096), bf16 and fp8. Each flag row names its baseline, the row of the
same call it is compared with.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# a ~1B Llama: llama-162m's 12 heads of 128 at width 1536, 32 blocks, SwiGLU 4096 (1.06B parameters)
LLAMA_1B = {"dim": 1536, "n_layers": 32, "ffn_dim": 4096}
# Qwen3-30B-A3B's MoE layer (128 experts, top-8, expert width 768, width 2048) in 2 blocks (1.85B parameters):
# the planner's MoE routing and grouped-GEMM costs against one GPU
QWEN3_MOE_2L = {"n_layers": 2}
# Llama 3 8B (width 4096, SwiGLU 14336, 32 heads of 128, 8 KV heads, vocabulary 128,256) in 4 blocks: 1.92B
# parameters, a third of them in the output head, which --dtype fp8 keeps in bf16 (train/float8.py)
LLAMA3_8B_4L = {"n_layers": 4}
SHAPED_LABEL = {"llama-162m": "llama-1b", "qwen3-30b-a3b": "qwen3-moe-2l", "llama3-8b": "llama3-8b-4l"}
CPU_TWIN = {"gpt2-124m": "gpt2-tiny", "llama-162m": "tiny", "qwen3-30b-a3b": "moe-tiny", "llama3-8b": "tiny"}
# issue 47's speed options: `paratrain train` flags, each a TrainConfig field of the same name
SPEED_FLAGS = ("bf16_residual", "fused_qkv", "fused_loss", "optimizer_graph", "bf16_param_copies", "fused_bias_gelu")
# the ones that change the model's code (how it is built or compiled), which the plain loop is given too, so that
# paratrain / plain still measures paratrain's loop; the others are the loop's own (loss, optimizer step, copies)
MODEL_CODE_FLAGS = ("bf16_residual", "fused_qkv", "fused_bias_gelu")
CPU_SHAPE = {"dim": 96, "n_layers": 3, "ffn_dim": 256}  # the ~1B row's CPU twin: still a config-file shape


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str  # train | plain | verify | doctor | calibrate | inference (benchmarks/inference.py)
    model: str = "gpt2-124m"
    dtype: str = "bf16"
    compile: bool = False
    cuda_graphs: bool = False
    micro_batch: int = 16
    seq_len: int = 1024
    shape: tuple = ()  # config overrides as (key, value) pairs: the ~1B row
    cold_s: float = 60.0  # guessed seconds on one H100, cold compile cache (results.json records real ones)
    warm_s: float = 20.0  # the same once a prewarm compiled its kernels
    pair: str | None = None  # train rows: the plain-loop row to compare with
    steps: int = 40
    warmup: int = 10
    name: str = ""  # a --dry-run twin keeps its GPU row's id
    flags: tuple = ()  # train rows: speed options given as flags (TrainConfig field names)
    baseline: str | None = None  # train rows with flags or fp8: the same call's row they are compared with

    @property
    def mode(self) -> str:
        return "compile-cudagraphs" if self.cuda_graphs else "compile" if self.compile else "eager"

    @property
    def model_label(self) -> str:
        return SHAPED_LABEL.get(self.model, self.model) if self.shape else self.model

    @property
    def variant(self) -> str:
        """The speed flags in a row's id: "" (none), one flag's name, or "all-flags"."""
        if set(self.flags) == set(SPEED_FLAGS):
            return "all-flags"
        return "+".join(f.replace("_", "-") for f in self.flags)

    @property
    def id(self) -> str:
        if self.name:
            return self.name
        if self.kind == "calibrate":
            return "calibrate"
        if self.kind == "verify":
            return f"verify-{self.model_label}-{self.dtype}-{self.mode}" + (f"+{self.variant}" if self.flags else "")
        mode = f"{self.mode}+{self.variant}" if self.flags else self.mode
        return f"{self.model_label}-{self.dtype}-{mode}-mb{self.micro_batch}-{self.kind}"

    def needs(self) -> list[str]:
        """What the machine must have: fp8 (Hopper/Ada + torchao), cuda_graphs, compile (triton on a GPU)."""
        out = []
        if self.dtype == "fp8":
            out.append("fp8")
        if self.cuda_graphs:
            out.append("cuda_graphs")
        if self.compile:
            out.append("compile")
        return out

    def cpu_twin(self) -> Row:
        """The --dry-run row: same id, kind and command, a tiny model on CPU, eager (inductor's C++ build of
        even the tiny model takes ~25 s a row on a 2-core machine); cuda_graphs and fp8 stay, so they skip."""
        if self.kind == "calibrate":
            return dataclasses.replace(self, name=self.id, cold_s=20.0, warm_s=20.0)
        shape = tuple(CPU_SHAPE.items()) if self.shape else ()
        dtype = self.dtype if self.kind == "verify" or self.dtype == "fp8" else "fp32"
        return dataclasses.replace(self, name=self.id, model=CPU_TWIN[self.model], shape=shape, dtype=dtype,
                                   compile=False, seq_len=64, micro_batch=2, steps=4, warmup=1, cold_s=10.0,
                                   warm_s=10.0)


def _train(model, dtype, mode, mb, **kw) -> list[Row]:
    """A paratrain train row, and (plain=True) the hand-written loop of the same step right after it."""
    plain = kw.pop("plain", False)
    pair = kw.pop("pair", None)
    base = Row("train", model, dtype, compile=mode != "eager", cuda_graphs=mode == "compile-cudagraphs",
               micro_batch=mb, **kw)
    if not plain:
        return [dataclasses.replace(base, pair=pair)]
    twin = dataclasses.replace(base, kind="plain")
    return [dataclasses.replace(base, pair=twin.id), twin]


def _graphs_pair(model: str, dtype: str, mb: int, shape: tuple = ()) -> str:
    """CUDA graphs rows compare with the plain compiled loop (the plain loop has no graph variant)."""
    return Row("plain", model, dtype, compile=True, micro_batch=mb, shape=shape).id


def _with_flags(base: Row, flags: tuple, **kw) -> Row:
    """`base` with speed flags, compared with `base`; its plain loop is the one given the same model code: the
    plain twin with its model-code flags (_plain_twins), or the baseline's own plain loop."""
    model_code = tuple(f for f in flags if f in MODEL_CODE_FLAGS)
    plain = Row("plain", base.model, base.dtype, compile=base.compile, micro_batch=base.micro_batch,
                seq_len=base.seq_len, shape=base.shape, flags=model_code)
    return dataclasses.replace(base, flags=flags, baseline=base.id, pair=plain.id, **kw)


def _plain_twins(rows: list[Row]) -> list[Row]:
    """The plain loops the flag rows pair with that no row defines yet, in the rows' order."""
    out: dict[str, Row] = {}
    for row in rows:
        flags = tuple(f for f in row.flags if f in MODEL_CODE_FLAGS)
        if row.kind == "train" and flags:
            twin = Row("plain", row.model, row.dtype, compile=row.compile, micro_batch=row.micro_batch,
                       seq_len=row.seq_len, shape=row.shape, flags=flags, cold_s=row.cold_s, warm_s=row.warm_s)
            out.setdefault(twin.id, twin)
    return list(out.values())


# Guessed times are for one H100 (results.json records each row's wall time: 27-32 s for a warm gpt2-124m row in
# the 2026-11 calls; the 8B-shaped rows also build 1.9B parameters on the host first).
BASE16, PLAIN16 = _train("gpt2-124m", "bf16", "compile", 16, plain=True, cold_s=75, warm_s=28)
BASE32, PLAIN32 = _train("gpt2-124m", "bf16", "compile", 32, plain=True, cold_s=75, warm_s=30)
LLAMA3_BF16 = Row("train", "llama3-8b", "bf16", compile=True, micro_batch=2, seq_len=4096,
                  shape=tuple(LLAMA3_8B_4L.items()), steps=20, warmup=5, cold_s=130, warm_s=70)
# issue 47: each speed flag on its own against the same call's compiled step, then all of them, at micro-batch 16;
# micro-batch 32 without and with all of them; FP8 against bf16 where the matmuls are large enough to pay
SPEED_ROWS: list[Row] = [
    BASE16,
    *(_with_flags(BASE16, (flag,)) for flag in SPEED_FLAGS),
    _with_flags(BASE16, SPEED_FLAGS, cold_s=85, warm_s=30),
    BASE32,
    _with_flags(BASE32, SPEED_FLAGS, cold_s=85, warm_s=32),
    LLAMA3_BF16,
    dataclasses.replace(LLAMA3_BF16, dtype="fp8", baseline=LLAMA3_BF16.id, cold_s=150, warm_s=80),
]

# Most valuable first: the budget cuts from the bottom.
GPU_ROWS: list[Row] = [
    *SPEED_ROWS,
    PLAIN16,
    *_plain_twins(SPEED_ROWS),
    *_train("gpt2-124m", "bf16", "compile-cudagraphs", 16, pair=_graphs_pair("gpt2-124m", "bf16", 16),
            baseline=BASE16.id, cold_s=80, warm_s=30),
    *_train("gpt2-124m", "fp8", "compile", 16, baseline=BASE16.id, cold_s=90, warm_s=30),
    Row("calibrate", cold_s=30, warm_s=30),
    # issue 50: paratrain generate against transformers' generate, batch 1 and micro_batch (8), greedy, KV cache
    Row("inference", "gpt2-124m", "fp32", micro_batch=8, seq_len=128, steps=1, cold_s=45, warm_s=40),
    Row("verify", "gpt2-124m", "fp32", seq_len=256, micro_batch=8, steps=3, cold_s=30, warm_s=30),
    Row("verify", "gpt2-124m", "bf16", seq_len=256, micro_batch=8, steps=3, cold_s=30, warm_s=30),
    Row("plain", "gpt2-124m", "fp8", compile=True, cold_s=80, warm_s=25),
    *_train("gpt2-124m", "bf16", "eager", 16, plain=True, cold_s=25, warm_s=25),
    *_train("llama-162m", "bf16", "compile", 16, plain=True, cold_s=75, warm_s=25),
    *_train("llama-162m", "bf16", "compile-cudagraphs", 16, pair=_graphs_pair("llama-162m", "bf16", 16),
            cold_s=80, warm_s=30),
    *_train("llama-162m", "fp8", "compile", 16, cold_s=90, warm_s=30),
    Row("doctor", "gpt2-124m", "bf16", compile=True, steps=5, warmup=3, cold_s=60, warm_s=35),
    PLAIN32,
    *_train("gpt2-124m", "bf16", "compile-cudagraphs", 32, pair=_graphs_pair("gpt2-124m", "bf16", 32),
            baseline=BASE32.id, cold_s=80, warm_s=30),
    *_train("gpt2-124m", "fp8", "compile", 32, baseline=BASE32.id, cold_s=90, warm_s=30),
    Row("verify", "gpt2-124m", "bf16", compile=True, seq_len=256, micro_batch=8, steps=3, cold_s=80, warm_s=80),
    Row("verify", "gpt2-124m", "bf16", compile=True, seq_len=256, micro_batch=8, steps=3, flags=SPEED_FLAGS,
        cold_s=120, warm_s=90),
    Row("verify", "gpt2-124m", "fp8", compile=True, seq_len=256, micro_batch=8, steps=3, cold_s=90, warm_s=90),
    *_train("llama-162m", "bf16", "eager", 8, shape=tuple(LLAMA_1B.items()), steps=25, warmup=5, cold_s=45,
            warm_s=45),
    *_train("llama-162m", "bf16", "compile", 8, plain=True, shape=tuple(LLAMA_1B.items()), steps=25, warmup=5,
            cold_s=180, warm_s=60),
    *_train("llama-162m", "fp8", "compile", 8, shape=tuple(LLAMA_1B.items()), steps=25, warmup=5, cold_s=200,
            warm_s=70, baseline=Row("train", "llama-162m", "bf16", compile=True, micro_batch=8,
                                    shape=tuple(LLAMA_1B.items())).id),
    *_train("qwen3-30b-a3b", "bf16", "eager", 2, seq_len=2048, shape=tuple(QWEN3_MOE_2L.items()), steps=15,
            warmup=5, cold_s=40, warm_s=40),
    Row("doctor", "qwen3-30b-a3b", "bf16", micro_batch=2, seq_len=2048, shape=tuple(QWEN3_MOE_2L.items()), steps=5,
        warmup=3, cold_s=50, warm_s=50),
    *_train("qwen3-30b-a3b", "bf16", "compile", 2, seq_len=2048, shape=tuple(QWEN3_MOE_2L.items()), steps=15,
            warmup=5, cold_s=120, warm_s=50),
]


def config_toml(row: Row) -> str | None:
    """The run config file a shaped row needs (the CLI has no --dim/--n-layers; the TOML does)."""
    if not row.shape:
        return None
    return "".join(f"{k} = {v}\n" for k, v in row.shape)


def command(row: Row, row_dir: Path, device: str, profile: Path, config: Path | None, prewarm: bool = False,
            calibrate_rounds: int = 5) -> list[str]:
    """The child's argv. `prewarm`: the same step for two or three steps, only to fill the compile caches."""
    from paratrain.cli_options import flag_of

    py = sys.executable
    common = ["--model", row.model, "--strategy", "single", "--nproc", "1", "--device", device,
              "--dtype", row.dtype, "--seq-len", str(row.seq_len), "--global-batch", str(row.micro_batch),
              "--compile" if row.compile else "--no-compile"]
    if config is not None:
        common += ["--config", str(config)]
    if row.kind == "calibrate":
        return [py, "-m", "paratrain.cli", "plan", "--calibrate", "--nproc", "1", "--calibrate-rounds",
                str(calibrate_rounds), "--hardware", str(profile), "--json"]
    if row.kind == "verify":
        return [py, "-m", "paratrain.cli", "verify", *common, *(flag_of(f) for f in row.flags), "--steps",
                str(row.steps), "--json"]
    if row.kind == "inference":  # prompts of seq_len / 2 tokens, as many new ones; steps: trained before export
        half = str(row.seq_len // 2)
        return [py, str(HERE / "inference.py"), "--model", row.model, "--device", device, "--dtype", row.dtype,
                "--batches", f"1,{row.micro_batch}", "--prompt-len", half, "--new-tokens", half, "--train-steps",
                str(row.steps), "--repeats", "3", "--json"]
    if row.kind == "doctor":
        return [py, "-m", "paratrain.cli", "doctor", *common, "--steps", str(row.steps),
                "--warmup", str(row.warmup), "--probe-rounds", "1", "--trace", str(row_dir / "trace.json"),
                "--out", str(row_dir / "run"), "--json"]
    steps = row.steps
    if prewarm:  # far enough to record the graphs: CUDA graph trees at step 3, --optimizer-graph after its eager ones
        from paratrain.train.optimizer_graph import EAGER_STEPS

        steps = EAGER_STEPS + 1 if "optimizer_graph" in row.flags else 3 if row.cuda_graphs else 2
    if row.kind == "plain":
        extra = ["--config", str(config)] if config else []
        return [py, str(HERE / "gpu_suite_plain.py"), "--model", row.model, "--device", device,
                "--dtype", row.dtype, "--seq-len", str(row.seq_len), "--micro-batch", str(row.micro_batch),
                "--compile" if row.compile else "--no-compile", "--warmup", str(1 if prewarm else row.warmup),
                "--steps", str(1 if prewarm else row.steps - row.warmup), *(flag_of(f) for f in row.flags), *extra]
    return [py, "-m", "paratrain.cli", "train", *common, *(flag_of(f) for f in row.flags),
            "--micro-batch", str(row.micro_batch),
            "--cuda-graphs" if row.cuda_graphs else "--no-cuda-graphs", "--steps", str(steps), "--lr", "3e-4",
            "--resume", "never", "--ckpt-every", "0", "--out", str(row_dir / ("prewarm" if prewarm else "run")),
            "--json"]


def code_path(row: Row) -> tuple:
    """What a --dry-run needs to run once: each kind of child (verify once per dtype), plain and shaped, and each
    set of speed flags (each is its own model or step code, worth a CPU run before device time is spent)."""
    return row.kind, row.dtype if row.kind == "verify" else None, bool(row.shape), row.flags
