"""`paratrain launch slurm|k8s|skypilot`: parse what is generated and check the fields; run the sbatch
script end to end with stand-ins for srun/scontrol (one node, two CPU ranks)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest
import tomllib
import yaml

from paratrain import cli
from paratrain.config import TrainConfig

TRAIN = [
    "--strategy",
    "zero3",
    "--steps",
    "3",
    "--global-batch",
    "16",
    "--seq-len",
    "32",
    "--ckpt-every",
    "3",
]


def launch(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(["launch", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def generated(*args: str) -> str:
    code, out, err = launch(*args)
    assert code == 0, err
    return out


def same_run(toml_text: str, **expect) -> TrainConfig:
    cfg = TrainConfig(**tomllib.loads(toml_text))
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key
    return cfg


def torchrun_tokens(script: str) -> list[str]:
    line = next(ln for ln in script.splitlines() if "torch.distributed.run" in ln)
    return shlex.split(line)


def check_torchrun(tokens: list[str], **flags) -> None:
    assert tokens[tokens.index("torch.distributed.run") + 1 :][:0] == []
    tail = tokens[tokens.index("-m", tokens.index("torch.distributed.run") + 1) :]
    assert tail[:4] == ["-m", "paratrain.cli", "train", "--config"]
    assert "--out" in tail
    for flag, value in flags.items():
        assert f"--{flag.replace('_', '-')}={value}" in tokens, (flag, tokens)


def bash_syntax_ok(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- Slurm ---------------------------------------------------------------------------------------------------
def test_sbatch_fields():
    script = generated(
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--partition",
        "gpu",
        "--account",
        "ml",
        "--time",
        "02:00:00",
        *TRAIN,
    )
    assert script.startswith("#!/bin/bash\n")
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1"
    assert directives["gpus-per-node"] == "4" and directives["partition"] == "gpu"
    assert directives["account"] == "ml" and directives["time"] == "02:00:00"
    assert directives["job-name"] == "paratrain-zero3"
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    tokens = shlex.split(srun)
    check_torchrun(tokens, nnodes=2, nproc_per_node=4, rdzv_backend="c10d", max_restarts=3)
    assert "--rdzv-endpoint=$HEAD_NODE:$PORT" in tokens and "--rdzv-id=$SLURM_JOB_ID" in tokens
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    config = script.split("<<'PARATRAIN_CONFIG_EOF'\n")[1].split("\nPARATRAIN_CONFIG_EOF\n")[0]
    same_run(config, strategy="zero3", steps=3, global_batch=16, seq_len=32, ckpt_every=3)
    bash_syntax_ok(script)


@pytest.mark.timeout(240)
def test_sbatch_script_trains_with_stand_in_srun(tmp_path):
    """One node, two CPU ranks: fake `scontrol` names the head node, fake `srun` runs the command once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    for tool in ("scontrol", "srun", "python"):
        (bin_dir / tool).chmod(0o755)
    script = generated(
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--device",
        "cpu",
        "--port",
        "29531",
        "--timeout-s",
        "60",
        *TRAIN,
    )
    (tmp_path / "job.sh").write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        ["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "paratrain-zero3-4242"
    assert (run_dir / "checkpoints" / "step-3" / "manifest.json").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def sbatch_directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))


def test_sbatch_cpu_job_asks_for_no_gpu_and_one_cpu_per_rank():
    """Issue 37: --device cpu on a small node (it asked for 2 GPUs and 16 CPUs)."""
    script = generated("slurm", "--gpus-per-node", "2", "--device", "cpu", *TRAIN)
    directives = sbatch_directives(script)
    assert "gpus-per-node" not in directives and "gres" not in directives
    assert directives["cpus-per-task"] == "2"
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in script
    assert 'srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-2}" ' in script
    more = generated("slurm", "--gpus-per-node", "2", "--device", "cpu", "--cpus-per-task", "8", *TRAIN)
    assert sbatch_directives(more)["cpus-per-task"] == "8"
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"' in more
    bash_syntax_ok(more)


def test_sbatch_gpu_defaults_and_mig():
    gpus = sbatch_directives(generated("slurm", "--gpus-per-node", "4", *TRAIN))
    assert gpus["gpus-per-node"] == "4" and gpus["cpus-per-task"] == "32"  # 8 per GPU, as before
    mig = generated("slurm", "--gpus-per-node", "2", "--mig", "3g.40gb", *TRAIN)
    directives = sbatch_directives(mig)
    assert directives["gres"] == "gpu:3g.40gb:2" and "gpus-per-node" not in directives
    assert "the gres type must be your site's name" in mig



def test_sbatch_asks_for_a_signal_before_its_end_and_requeues():
    """Issue 37: a warning signal, the trap that passes it to the ranks (torchrun ignores it), and the requeue
    on preempted.json; --preempt-signal picks the signal. The real thing: test_real_slurm.py."""
    script = generated("slurm", "--gpus-per-node", "2", "--device", "cpu", *TRAIN)
    directives = sbatch_directives(script)
    assert directives["signal"] == "B:USR1@120" and directives["open-mode"] == "append"
    assert "#SBATCH --requeue" in script.splitlines()
    assert same_run(script.split("<<'PARATRAIN_CONFIG_EOF'\n")[1].split("PARATRAIN_CONFIG_EOF")[0],
                    preempt_signal="USR1")
    assert "trap on_preempt USR1" in script and """bash -c 'trap "" USR1; exec "$@"' paratrain-rank""" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "exit 75" in script
    usr2 = generated("slurm", "--gpus-per-node", "2", "--device", "cpu", "--preempt-signal", "USR2", *TRAIN)
    assert sbatch_directives(usr2)["signal"] == "B:USR2@120" and "trap on_preempt USR2" in usr2
    bash_syntax_ok(usr2)


def test_skypilot_cpu_task():
    doc = yaml.safe_load(generated("skypilot", "--gpus-per-node", "2", "--device", "cpu", *TRAIN))
    assert doc["resources"] == {"cpus": "2+"} and doc["envs"]["OMP_NUM_THREADS"] == "1"
    assert "--nproc-per-node=2" in torchrun_tokens(doc["run"])


# -- Kubernetes ----------------------------------------------------------------------------------------------
def container_script(command: list[str]) -> str:
    assert command[:2] == ["bash", "-c"]
    bash_syntax_ok(command[2])
    return command[2]


def test_trainjob_fields():
    doc, _policy = yaml.safe_load_all(
        generated(
            "k8s",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--image",
            "reg/pt:1",
            "--namespace",
            "team",
            *TRAIN,
        )
    )
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    assert doc["metadata"] == {"name": "paratrain-zero3", "namespace": "team"}
    assert doc["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = doc["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["image"] == "reg/pt:1"
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8"}  # a quantity, as the API writes it
    assert trainer["numProcPerNode"] == 8
    script = container_script(trainer["command"])
    check_torchrun(torchrun_tokens(script), max_restarts=3)
    env = {e["name"]: e["value"] for e in trainer["env"]}
    same_run(env["PARATRAIN_CONFIG_TOML"], strategy="zero3", steps=3)


def test_pytorchjob_fields():
    doc, _policy = yaml.safe_load_all(
        generated(
            "k8s",
            "--k8s-api",
            "pytorchjob",
            "--nodes",
            "3",
            "--gpus-per-node",
            "4",
            "--strategy",
            "ddp",
            "--global-batch",
            "24",
            "--max-restarts",
            "1",
        )
    )
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["spec"]["nprocPerNode"] == "4"
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        check_torchrun(torchrun_tokens(container_script(container["command"])), max_restarts=1)
        env = {e["name"]: e["value"] for e in container["env"]}
        same_run(env["PARATRAIN_CONFIG_TOML"], strategy="ddp", global_batch=24)


# -- SkyPilot ------------------------------------------------------------------------------------------------
def test_skypilot_fields():
    doc = yaml.safe_load(
        generated(
            "skypilot",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--accelerator",
            "A100",
            "--cloud",
            "aws",
            *TRAIN,
        )
    )
    assert doc["name"] == "paratrain-zero3" and doc["num_nodes"] == 2
    assert doc["resources"] == {"accelerators": "A100:8", "cloud": "aws"}
    same_run(doc["envs"]["PARATRAIN_CONFIG_TOML"], strategy="zero3", steps=3)
    bash_syntax_ok(doc["run"])
    tokens = torchrun_tokens(doc["run"])
    check_torchrun(
        tokens,
        nnodes="$SKYPILOT_NUM_NODES",
        nproc_per_node="$SKYPILOT_NUM_GPUS_PER_NODE",
        rdzv_backend="c10d",
    )
    assert "--rdzv-endpoint=$HEAD_IP:29500" in tokens


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [
        (["nomad"], "unknown launch target 'nomad'"),
        (["slurm", "--nodes", "0"], "--nodes must be at least 1"),
        (["k8s", "--k8s-api", "mpijob"], "--k8s-api must be one of"),
        (["k8s", "--job-name", "Bad_Name"], "job name 'Bad_Name'"),
        (["slurm", "--nodes", "3", "--gpus-per-node", "1", "--strategy", "ddp", "--global-batch", "16"], "not divisible"),
        (["skypilot", "--strategy", "auto"], "--strategy auto"),
        (["slurm", "--queue", "team"], "--queue is Kubernetes only (Kueue's LocalQueue) (Slurm: --partition)"),
        (["k8s", "--queue", "bad queue"], "--queue 'bad queue' is not a valid value"),
        (["k8s", "--mig", "3g.41gb"], "unknown MIG profile '3g.41gb'; valid: 1g.5gb, 1g.10gb"),
        (["k8s", "--gpu-share", "20000"], "--gpu-share '20000' must be MEM_MIB:CORES_PCT"),
        (["k8s", "--gpu-share", "20000:150"], "cores 1..100"),
        (["slurm", "--gpu-share", "20000:50"], "--gpu-share is Kubernetes only"),
        (["skypilot", "--mig", "3g.40gb"], "--mig is for slurm and k8s"),
        (["k8s", "--mig", "3g.40gb", "--gpu-share", "1000:10"], "give one"),
        (["slurm", "--device", "cpu", "--mig", "3g.40gb"], "--mig asks for GPUs"),
        (["slurm", "--device", "cpu", "--gpus-per-node", "4", "--cpus-per-task", "2"],
         "--cpus-per-task 2 is fewer than the 4 ranks per node"),
    ],
)
def test_bad_launch_input_is_one_line_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = launch(*args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_output_file(tmp_path):
    target = tmp_path / "job.yaml"
    code, out, err = launch("skypilot", "-o", str(target))
    assert code == 0 and out == "" and f"wrote {target}" in err
    assert yaml.safe_load(target.read_text())["num_nodes"] == 1
