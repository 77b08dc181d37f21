"""Issue 37: every manifest `paratrain launch k8s` writes is read by the APIs' own client models, strictly.

TrainJob: kubeflow-trainer-api's TrainerV1alpha1TrainJob (from_dict / to_dict). PyTorchJob: kubeflow-training's
KubeflowOrgV1PyTorchJob through its ApiClient (deserialize / sanitize_for_serialization), whose pod template
is the `kubernetes` client's V1PodTemplateSpec. NetworkPolicy: the `kubernetes` client's V1NetworkPolicy.
A model keeps only the fields it knows and converts values to its types, so the round trip must give back the
manifest exactly: a misspelt or unknown field, or a value of the wrong type, is a difference."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import yaml

from reliability.inproc import run_cli_inproc


def generated(*args: str) -> str:
    code, out, err = run_cli_inproc(["launch", *args])
    assert code == 0, err
    return out


def _models():
    try:
        from kubeflow.training.api_client import ApiClient as TrainingClient
        from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
        from kubernetes.client import ApiClient as KubernetesClient
    except ImportError as exc:  # the test extra installs them; CI must not skip silently
        if os.environ.get("CI") == "true":
            raise AssertionError(f"Kubernetes client models missing under CI ({exc}): pip install -e '.[test]'") from exc
        pytest.skip(f"Kubernetes client models not installed ({exc.name}): pip install -e '.[test]'")
    return TrainerV1alpha1TrainJob, TrainingClient(), KubernetesClient()


def _through_client(client, doc: dict, kind: str) -> dict:
    obj = client.deserialize(SimpleNamespace(data=json.dumps(doc)), kind)
    return client.sanitize_for_serialization(obj)


def round_trip(doc: dict) -> dict:
    """The manifest as the API's client model reads it back."""
    trainjob, training, kubernetes = _models()
    if doc["kind"] == "TrainJob":
        return trainjob.from_dict(doc).to_dict()
    if doc["kind"] == "PyTorchJob":
        return _through_client(training, doc, "KubeflowOrgV1PyTorchJob")
    assert doc["kind"] == "NetworkPolicy", doc["kind"]
    return _through_client(kubernetes, doc, "V1NetworkPolicy")


def differences(ours, theirs, path: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(ours) | set(theirs), key=str)
                for d in (differences(ours[k], theirs[k], f"{path}.{k}") if k in ours and k in theirs
                          else [f"{path}.{k}: {'dropped by the model' if k in ours else 'added by the model'}"])]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs and type(ours) is type(theirs) else [f"{path}: {ours!r} read back as {theirs!r}"]


def check_strictly(doc: dict) -> None:
    diff = differences(doc, round_trip(doc))
    assert not diff, f"{doc['kind']} does not match its API model: {diff}"


def manifests(*args: str) -> list[dict]:
    return list(yaml.safe_load_all(generated("k8s", "--strategy", "ddp", "--global-batch", "16", *args)))


def limits(doc: dict) -> dict:
    if doc["kind"] == "TrainJob":
        return doc["spec"]["trainer"]["resourcesPerNode"]["limits"]
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    return container["resources"]["limits"]


def env(doc: dict) -> dict:
    if doc["kind"] == "TrainJob":
        return {e["name"]: e["value"] for e in doc["spec"]["trainer"]["env"]}
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


API = ["trainjob", "pytorchjob"]
OPTIONS = {
    "whole GPUs": (["--nodes", "2", "--gpus-per-node", "4", "--namespace", "team"],
                   {"nvidia.com/gpu": "4"}, "8"),
    "Kueue queue": (["--gpus-per-node", "2", "--queue", "team-a"], {"nvidia.com/gpu": "2"}, "8"),
    "MIG slices": (["--gpus-per-node", "2", "--mig", "3g.40gb"], {"nvidia.com/mig-3g.40gb": "2"}, "8"),
    "shared GPUs (HAMi)": (["--gpus-per-node", "2", "--gpu-share", "20000:50", "--cpus-per-task", "8"],
                           {"cpu": "8", "nvidia.com/gpu": "2", "nvidia.com/gpumem": "20000",
                            "nvidia.com/gpucores": "50"}, "4"),
    "CPU": (["--gpus-per-node", "2", "--device", "cpu"], {"cpu": "2"}, "1"),
    "CPU, 4 CPUs": (["--nodes", "4", "--gpus-per-node", "2", "--device", "cpu", "--cpus-per-task", "4",
                     "--queue", "cpu-queue"], {"cpu": "4"}, "2"),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("api", API)
def test_every_manifest_matches_the_api_models(api, option):
    args, want_limits, threads = OPTIONS[option]
    job, policy = manifests("--k8s-api", api, *args)
    check_strictly(job)
    check_strictly(policy)
    assert limits(job) == want_limits
    assert env(job)["OMP_NUM_THREADS"] == threads
    labels = job["metadata"].get("labels", {})
    queue = args[args.index("--queue") + 1] if "--queue" in args else None
    assert labels == ({"kueue.x-k8s.io/queue-name": queue} if queue else {})
    if api == "trainjob":
        assert job["spec"]["trainer"]["numProcPerNode"] == int(args[args.index("--gpus-per-node") + 1])


@pytest.mark.parametrize(
    "api,path,wrong",
    [
        ("trainjob", ("spec", "trainer"), ("numNodes", "numnodes")),  # misspelt
        ("trainjob", ("spec", "trainer", "resourcesPerNode"), ("limits", "limit")),
        ("trainjob", ("spec", "trainer"), ("numProcPerNode", "numProcPerNode", "2")),  # wrong type
        ("pytorchjob", ("spec", "pytorchReplicaSpecs", "Master"), ("restartPolicy", "restart_policy")),
        ("pytorchjob", ("spec",), ("nprocPerNode", "nprocPerNode", 2)),  # the API's type is a string
    ],
)
def test_a_wrong_field_fails_the_check(api, path, wrong):
    job, _policy = manifests("--k8s-api", api, "--gpus-per-node", "2")
    node = job
    for key in path:
        node = node[key]
    old, new, *value = wrong
    node[new] = value[0] if value else node.pop(old)
    with pytest.raises((AssertionError, ValueError)):
        check_strictly(job)


def test_a_wrong_container_field_fails_the_check():
    job, _policy = manifests("--k8s-api", "pytorchjob", "--gpus-per-node", "2")
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    container["resource"] = container.pop("resources")
    with pytest.raises(AssertionError, match="resource: dropped by the model"):
        check_strictly(job)
