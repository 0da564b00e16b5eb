"""deploy/kubernetes: every built-in object passes kubernetes-validate's strict schemas; the
ServiceMonitor (a CRD, which it has no schema for) is checked here field by field against the
monitoring.coreos.com/v1 ServiceMonitor's; and the pieces agree with each other, with the image
and with the daemon's settings (which are loaded as the daemon would load them)."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tidalcore.units import parse_size
from tidalpoold.settings import Settings, add_arguments, settings_from_args

from .test_container import image_env

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"tidalpoold:{VERSION}"
DAEMON_UID = 10001  # the image's USER
GPUS = 8  # DaemonSets tidalpoold-gpu0 .. tidalpoold-gpu7
# Dynamic resource allocation (resource.k8s.io/v1) and native sidecars: 1.34 and later.
OLDEST, NEWEST = "1.34.0", kubernetes_validate.latest_version()

Object = dict[str, Any]


def objects(relative: str) -> list[Object]:
    docs = []
    for path in sorted((KUBERNETES / relative).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def named(docs: list[Object], kind: str, name: str | None = None) -> Object:
    (found,) = (d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"]))
    return found


def env_of(container: Object) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def daemon_settings(container: Object, config: dict[str, str], tmp: Path) -> Settings:
    """The settings tidalpoold loads in `container`: the image's variables, the container's,
    its arguments, and the TOML file a ConfigMap mounts (from `config`: path -> text)."""
    env = {**image_env(), **env_of(container)}
    if "TIDALPOOLD_CONFIG" in env:
        file = tmp / "tidalpoold.toml"
        file.write_text(config[env["TIDALPOOLD_CONFIG"]])
        env["TIDALPOOLD_CONFIG"] = str(file)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert container["image"] == IMAGE
    return settings_from_args(parser.parse_args(container.get("args", [])), env)


def mounts(pod: Object, container: Object) -> dict[str, Object]:
    """mountPath -> the pod's volume mounted there."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def memory_limit(container: Object) -> int:
    return parse_size(container["resources"]["limits"]["memory"].replace("Gi", "GiB"))


HEALTH = ["tidalpool", "health", "--timeout", "4"]


def check_probes(container: Object) -> None:
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == HEALTH
        assert float(HEALTH[-1]) < container[probe]["timeoutSeconds"]


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
@pytest.mark.parametrize("relative", ["node", "sidecar", "job"])
def test_every_built_in_object_is_valid(relative: str, version: str) -> None:
    docs = [d for d in objects(relative) if d["apiVersion"] != "monitoring.coreos.com/v1"]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_would_be_caught() -> None:
    daemonset = named(objects("node"), "DaemonSet", "tidalpoold-gpu0")
    daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(daemonset, OLDEST, strict=True)


def test_the_daemonsets_differ_in_the_gpu_index_alone() -> None:
    daemonsets = [d for d in objects("node") if d["kind"] == "DaemonSet"]
    assert [d["metadata"]["name"] for d in daemonsets] == [
        f"tidalpoold-gpu{i}" for i in range(GPUS)
    ]

    def for_gpu(value: Any, i: int) -> Any:
        if isinstance(value, dict):
            return {k: for_gpu(v, i) for k, v in value.items()}
        if isinstance(value, list):
            return [for_gpu(v, i) for v in value]
        if isinstance(value, str):
            return str(i) if value == "0" else value.replace("gpu0", f"gpu{i}")
        return value

    for i, daemonset in enumerate(daemonsets):
        assert daemonset == for_gpu(daemonsets[0], i)


def test_each_gpu_has_a_daemon_with_its_own_settings_and_sockets(tmp_path: Path) -> None:
    docs = objects("node")
    config_map = named(docs, "ConfigMap", "tidalpoold-config")
    namespace = named(docs, "Namespace")["metadata"]["name"]
    for i in range(GPUS):
        daemonset = named(docs, "DaemonSet", f"tidalpoold-gpu{i}")
        assert (
            daemonset["metadata"]["namespace"] == config_map["metadata"]["namespace"] == namespace
        )
        pod = daemonset["spec"]["template"]["spec"]
        labels = daemonset["spec"]["template"]["metadata"]["labels"]
        assert daemonset["spec"]["selector"]["matchLabels"] == labels
        assert labels["tidalpool/gpu"] == str(i)
        # Only on nodes with more than i GPUs.
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchExpressions"] == [
            {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": [str(i)]}
        ]
        (container,) = pod["containers"]
        paths = mounts(pod, container)
        config_dir = next(p for p, v in paths.items() if "configMap" in v)
        assert paths[config_dir]["configMap"]["name"] == "tidalpoold-config"
        config = {f"{config_dir}/{k}": v for k, v in config_map["data"].items()}
        s = daemon_settings(container, config, tmp_path)
        assert (s.gpu, s.backend, s.socket_dir) == (i, "cuda", Path(f"/run/tidalpool/gpu{i}"))
        assert env_of(container)["TIDALPOOL_SOCKET_DIR"] == str(s.socket_dir)  # for the probes
        assert env_of(container)["NVIDIA_VISIBLE_DEVICES"] == "all"
        # The sockets and the plan cache are the node's directories, made the daemon's first.
        assert paths["/run/tidalpool"]["hostPath"]["path"] == "/run/tidalpool"
        assert s.socket_dir.parent == Path("/run/tidalpool")
        assert paths[str(s.plan_cache_dir)]["hostPath"]["path"] == str(s.plan_cache_dir)
        (init,) = pod["initContainers"]
        assert init["image"] == IMAGE
        assert init["command"] == [
            *("install", "-d", "-o", str(DAEMON_UID), "-g", str(DAEMON_UID), "-m", "0750"),
            *(str(s.socket_dir), str(s.plan_cache_dir)),
        ]
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert (
            pod["securityContext"]["runAsUser"]
            == pod["securityContext"]["runAsGroup"]
            == DAEMON_UID
        )
        assert s.allowed_gids == (DAEMON_UID,)
        # The metrics port, and memory for the memfd host pool and the daemon itself.
        (port,) = container["ports"]
        assert (port["name"], port["containerPort"]) == ("metrics", 9477)
        assert s.metrics_address == "0.0.0.0:9477"
        assert memory_limit(container) >= s.host_pool + parse_size("1GiB")
        check_probes(container)
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_prometheus_finds_every_daemon_through_the_headless_service() -> None:
    docs = objects("node")
    service = named(docs, "Service", "tidalpoold")
    monitor = named(docs, "ServiceMonitor", "tidalpoold")
    assert service["spec"]["clusterIP"] == "None"
    for daemonset in (d for d in docs if d["kind"] == "DaemonSet"):
        labels = daemonset["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        (container,) = daemonset["spec"]["template"]["spec"]["containers"]
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in [p["name"] for p in container["ports"]]
    # The ServiceMonitor: only fields of the monitoring.coreos.com/v1 CRD's schema, with the
    # types and patterns it gives them, pointing at the Service above.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert spec["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) == {"port", "path", "interval", "relabelings"}
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    duration = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?" + (
        r"(([0-9]+)s)?(([0-9]+)ms)?)$"
    )
    assert re.match(duration, endpoint["interval"])
    for rule in endpoint["relabelings"]:
        assert set(rule) <= {"sourceLabels", "targetLabel", "regex", "replacement", "action"}
        assert all(re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", label) for label in rule["sourceLabels"])


def test_the_sidecar_shares_the_gpu_and_the_sockets_with_the_training_container(
    tmp_path: Path,
) -> None:
    docs = objects("sidecar")
    template = named(docs, "ResourceClaimTemplate")
    pod_object = named(docs, "Pod")
    pod = pod_object["spec"]
    (daemon,) = pod["initContainers"]
    (train,) = pod["containers"]
    # A native sidecar: started first, ready by its probe, stopped after the training ends.
    assert daemon["restartPolicy"] == "Always"
    check_probes(daemon)
    s = daemon_settings(daemon, {}, tmp_path)
    # The sockets are in a directory the daemon makes inside the shared emptyDir (writable by
    # every uid, so not one to serve from), and the training process trusts the daemon's uid.
    assert (s.gpu, s.backend, s.socket_dir) == (0, "cuda", Path("/run/tidalpool/sockets"))
    assert env_of(train)["TIDALPOOL_SOCKET_DIR"] == str(s.socket_dir)
    sockets = mounts(pod, daemon)[str(s.socket_dir.parent)]
    assert "emptyDir" in sockets and mounts(pod, train)[str(s.socket_dir.parent)] is sockets
    assert env_of(train)["TIDALPOOL_DAEMON_USERS"] == str(DAEMON_UID)
    # One claim, from the template, for both containers.
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for container in (daemon, train):
        assert container["resources"]["claims"] == [{"name": claim["name"]}]
    # The daemon admits the training process: same uid, or its primary group is allowed.
    context = pod["securityContext"]
    daemon_uid = daemon["securityContext"].get("runAsUser", context.get("runAsUser"))
    train_uid = train["securityContext"].get("runAsUser", context.get("runAsUser"))
    train_gid = train["securityContext"].get("runAsGroup", context.get("runAsGroup"))
    assert daemon_uid == DAEMON_UID
    assert train_uid == daemon_uid or train_gid in s.allowed_gids
    assert context["fsGroup"] == train_gid  # the emptyDir, and so the sockets, are its group's
    assert memory_limit(daemon) >= s.host_pool + parse_size("1GiB")


def test_a_pod_of_several_gpus_reaches_each_gpus_daemon() -> None:
    """The torchrun pod beside the DaemonSets: all of a node's GPUs in the daemons' order, the
    node's socket directories, the daemons' group and uid."""
    pod = named(objects("job"), "Pod")
    (train,) = pod["spec"]["containers"]
    gpus = int(train["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == GPUS and train["command"][:3] == ["torchrun", "--standalone", "--nproc_per_node"]
    assert train["command"][3] == str(gpus)  # one rank per GPU
    env = env_of(train)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TIDALPOOL_DAEMON_USERS"] == str(DAEMON_UID)
    assert "TIDALPOOL_SOCKET_DIR" not in env  # each rank finds /run/tidalpool/gpu<N>
    assert pod["spec"]["securityContext"]["runAsGroup"] == DAEMON_UID
    sockets = mounts(pod["spec"], train)["/run/tidalpool"]
    assert sockets["hostPath"]["path"] == "/run/tidalpool"
    daemonset = named(objects("node"), "DaemonSet", "tidalpoold-gpu0")
    env0 = env_of(daemonset["spec"]["template"]["spec"]["containers"][0])
    assert env0["TIDALPOOLD_SOCKET_DIR"] == "/run/tidalpool/gpu0"  # the layout the ranks expect
