"""Issue 19, defects 2, 8 and 10: generated job files cannot be injected, cluster files are locked down,
and the default global batch follows the cluster.

The generated scripts are executed here with stand-ins for srun/scontrol/python: a payload such as
`$(touch pwned)` in a user value must arrive as literal text and never run."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import tomllib
import yaml

from reliability.inproc import run_cli_inproc

PAYLOAD = "runs/$(touch pwned)`touch pwned2`;touch pwned3"


def generate(tmp_path, *args: str) -> tuple[int, str, str]:
    return run_cli_inproc(["launch", *args], cwd=tmp_path)


def stand_ins(tmp_path):
    """srun (runs its command), scontrol (names a node), python (records its argv and the --config text)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "python-argv"
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        f"printf '%s\\n' \"$@\" > {shlex.quote(str(record))}\n"
        'while [ $# -gt 0 ]; do if [ "$1" = --config ]; then cp "$2" '
        f"{shlex.quote(str(tmp_path / 'config-seen.toml'))}; fi; shift; done\n")
    for tool in ("scontrol", "srun", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "SKYPILOT_NODE_IPS": "10.0.0.1", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "2", "SKYPILOT_TASK_ID": "t", "HOME": str(tmp_path)}
    return env, record


def run_script(tmp_path, script: str, extra_env: dict | None = None) -> list[str]:
    env, record = stand_ins(tmp_path)
    env.update(extra_env or {})
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pwned = [p.name for p in work.rglob("pwned*")] + [p.name for p in tmp_path.glob("pwned*")]
    assert pwned == [], f"a user value ran as a command: {pwned}"
    return record.read_text().splitlines()


def out_arg(argv: list[str]) -> str:
    return argv[argv.index("--out") + 1]


def test_slurm_takes_user_values_literally(tmp_path):
    code, script, err = generate(tmp_path, "slurm", "--nodes", "1", "--gpus-per-node", "2", "--out", PAYLOAD)
    assert code == 0, err
    argv = run_script(tmp_path, script)
    assert out_arg(argv) == PAYLOAD
    assert (tmp_path / "work" / PAYLOAD).is_dir(), "the run dir was not created under its literal name"
    config = tomllib.loads((tmp_path / "config-seen.toml").read_text())
    assert config["out"] == PAYLOAD


@pytest.mark.parametrize("target", ["k8s", "k8s-pytorchjob", "skypilot"])
def test_yaml_scripts_take_user_values_literally(tmp_path, target):
    args = ["k8s", "--k8s-api", "pytorchjob"] if target == "k8s-pytorchjob" else [target]
    code, text, err = generate(tmp_path, *args, "--nodes", "1", "--gpus-per-node", "2", "--out", PAYLOAD)
    assert code == 0, err
    docs = list(yaml.safe_load_all(text))
    if target == "skypilot":
        script, env = docs[0]["run"], docs[0]["envs"]
    else:
        spec = docs[0]["spec"]
        container = (spec["trainer"] if "trainer" in spec else
                     spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0])
        script, env = container["command"][2], {e["name"]: e["value"] for e in container["env"]}
    argv = run_script(tmp_path, script, env)
    assert out_arg(argv) == PAYLOAD
    config_path = argv[argv.index("--config") + 1]
    assert config_path != "/tmp/paratrain-config.toml" and os.path.basename(config_path).startswith("paratrain-config.")
    assert tomllib.loads((tmp_path / "config-seen.toml").read_text())["out"] == PAYLOAD


@pytest.mark.parametrize("args,message", [
    (["slurm", "--partition", "gpu\ntouch pwned"], "--partition 'gpu\\ntouch pwned' is not a valid value"),
    (["slurm", "--account", "ml$(touch pwned)"], "--account 'ml$(touch pwned)' is not a valid value"),
    (["slurm", "--time", "1:00\n#SBATCH --uid=0"], "--time"),
    (["k8s", "--image", "img\u2028x: 1"], "--image"),
    (["k8s", "--namespace", "Team A"], "--namespace"),
    (["skypilot", "--accelerator", "H100\nsetup: rm -rf /"], "--accelerator"),
    (["k8s", "--out", "runs/a\u2028b"], "'out': Value error, contains a control or line-break character"),
    (["skypilot", "--data", "x\u0085y"], "'data': Value error, contains a control or line-break character"),
    (["slurm", "--out", "PARATRAIN_CONFIG_EOF"], "contains PARATRAIN_CONFIG_EOF"),
])
def test_values_that_would_break_a_line_are_one_line_exit_2(tmp_path, args, message):
    code, out, err = generate(tmp_path, *args, "-o", "job.txt")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "an exit-2 run left a file behind"


def test_yaml_literal_blocks_never_hold_unicode_line_breaks():
    from paratrain.launchers.common import to_yaml

    for text in ["a\nb\u2028c: 1\n", "a\nb\u0085c\n", "a\nb\u2029\n", "a\nb\x0bc\n", "a\rb\nc\n"]:
        assert yaml.safe_load(to_yaml({"k": text, "after": 1})) == {"k": text, "after": 1}


def test_k8s_network_policy_admits_only_the_jobs_pods(tmp_path):
    for api, label in (("trainjob", "jobset.sigs.k8s.io/jobset-name"), ("pytorchjob", "training.kubeflow.org/job-name")):
        code, text, err = generate(tmp_path, "k8s", "--k8s-api", api, "--nodes", "2", "--gpus-per-node", "2",
                                   "--namespace", "team")
        assert code == 0, err
        job, policy = yaml.safe_load_all(text)
        assert policy["kind"] == "NetworkPolicy" and policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["metadata"]["namespace"] == "team"
        pods = {"matchLabels": {label: job["metadata"]["name"]}}
        assert policy["spec"]["podSelector"] == pods and policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["ingress"] == [{"from": [{"podSelector": pods}]}]


def test_skypilot_installs_the_workdir_not_an_unpinned_name(tmp_path):
    code, text, err = generate(tmp_path, "skypilot", "--nodes", "2", "--gpus-per-node", "2")
    assert code == 0, err
    doc = yaml.safe_load(text)
    assert doc["workdir"] == "." and doc["setup"].strip() == "pip install ."
    assert "/tmp/paratrain-config.toml" not in text and "mktemp" in doc["run"]


def test_default_global_batch_scales_to_the_cluster(tmp_path):
    code, script, err = generate(tmp_path, "slurm", "--nodes", "4", "--gpus-per-node", "8")
    assert code == 0, err
    assert "the default global batch 16 does not divide over 32 data-parallel ranks; using 32" in err
    config = script.split("<<'PARATRAIN_CONFIG_EOF'\n")[1].split("\nPARATRAIN_CONFIG_EOF\n")[0]
    assert tomllib.loads(config)["global_batch"] == 32
    (tmp_path / "mine.toml").write_text("global_batch = 16\n")
    for given in (["--global-batch", "16"], ["--config", "mine.toml"]):  # a batch the user set is kept
        code, _, err = generate(tmp_path, "slurm", "--nodes", "4", "--gpus-per-node", "8", *given)
        assert code == 2 and "global batch 16 is not divisible by the data-parallel degree 32" in err, err
