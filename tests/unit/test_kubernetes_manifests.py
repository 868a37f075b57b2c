"""deploy/kubernetes: the kustomize base and the example overlay, validated offline against
the Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors), and the
properties docs/kubernetes.md promises checked on the objects.

Every manifest file of the base is validated as it is; the overlay (and the base) are also
rendered with `kubectl kustomize` (kustomize built in) when kubectl is installed.
"""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
VERSION = "1.30.0"  # the oldest Kubernetes release the manifests are written for
APP = {"web", "worker", "beat", "init"}


def validate_all(objects: list[dict]) -> None:
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            raise AssertionError(f"{name}: {exc.message} at {'.'.join(map(str, exc.path))}") from None


def base_objects() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    objects = []
    for resource in kustomization["resources"]:
        objects += [doc for doc in yaml.safe_load_all((K8S / "base" / resource).read_text()) if doc]
    return objects


def rendered(directory: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not installed: the kustomize rendering is not checked (the base files are)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def test_every_base_manifest_validates_against_the_kubernetes_schemas():
    objects = base_objects()
    assert {o["kind"] for o in objects} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "Job",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ConfigMap",
        "PersistentVolumeClaim",
    }
    validate_all(objects)


@pytest.mark.parametrize("directory", ["base", "overlays/example"])
def test_the_rendered_kustomizations_validate(directory):
    objects = rendered(directory)
    validate_all(objects)
    if directory == "overlays/example":
        assert all(o["metadata"].get("namespace") == "aap" for o in objects if o["kind"] != "Namespace")
        for deployment in by_kind(objects, "Deployment").values():
            assert pod_spec(deployment)["containers"][0]["image"] == "registry.example.com/aap-hosting:1.0.0"
        worker = pod_spec(by_kind(objects, "Deployment")["aap-worker"])
        assert worker["securityContext"]["seccompProfile"] == {
            "type": "Localhost",
            "localhostProfile": "profiles/aap-worker.json",
        }
        job = by_kind(objects, "Job")["aap-init"]
        agents = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("aap-agents"))
        assert pod_spec(job)["volumes"][0]["configMap"]["name"] == agents["metadata"]["name"]


def test_web_is_probed_on_healthz_and_scaled_by_an_autoscaler():
    objects = base_objects()
    web = pod_spec(by_kind(objects, "Deployment")["aap-web"])["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert web[probe]["httpGet"]["path"] == "/healthz", probe
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["aap-web"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "aap-web"}
    assert hpa["spec"]["minReplicas"] >= 2


def test_workers_stop_gracefully_and_beat_runs_alone():
    deployments = by_kind(base_objects(), "Deployment")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose_grace = int(compose["services"]["worker"]["stop_grace_period"].rstrip("s"))
    worker = pod_spec(deployments["aap-worker"])
    assert worker["terminationGracePeriodSeconds"] >= 10 * compose_grace, "longer than the longest turn"
    assert worker["terminationGracePeriodSeconds"] > pod_spec(deployments["aap-web"]).get(
        "terminationGracePeriodSeconds", 30
    )
    beat = deployments["aap-beat"]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
    assert not by_kind(base_objects(), "HorizontalPodAutoscaler").keys() - {"aap-web"}


def test_the_init_job_runs_migrations_and_the_agents_file():
    job = by_kind(base_objects(), "Job")["aap-init"]
    container = pod_spec(job)["containers"][0]
    assert container["args"] == ["init"]
    assert {"mountPath": "/config", "name": "agents", "readOnly": True} in container["volumeMounts"]
    for copy in (K8S / "base" / "agents.example.yaml", K8S / "overlays" / "example" / "agents.yaml"):
        assert copy.read_text() == (ROOT / "deploy" / "agents.example.yaml").read_text(), copy


def test_disruption_budgets_cover_web_and_workers():
    budgets = by_kind(base_objects(), "PodDisruptionBudget")
    components = {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for b in budgets.values()}
    assert components == {"web", "worker"}


def test_only_the_service_reaches_postgresql_and_redis():
    policies = by_kind(base_objects(), "NetworkPolicy")
    for name, port in (("aap-postgresql", 5432), ("aap-redis", 6379)):
        spec = policies[name]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": port}]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, "no namespaceSelector or ipBlock: this namespace's pods only"
        expressions = {e["key"]: set(e["values"]) for e in peer["podSelector"]["matchExpressions"]}
        assert expressions == {"app.kubernetes.io/name": {"aap-hosting"}, "app.kubernetes.io/component": APP}
        assert {"web", "worker"} <= expressions["app.kubernetes.io/component"]


def test_secrets_come_from_a_secret_and_never_from_the_manifests():
    objects = base_objects()
    assert not by_kind(objects, "Secret"), "the operator creates aap-secrets (docs/kubernetes.md)"
    secret_names = {"SECRET_KEY", "HOSTING_ENCRYPTION_KEYS", "DATABASE_URL", "AAP_WORKER_DATABASE_URL", "REDIS_URL"}
    for config in by_kind(objects, "ConfigMap").values():
        assert not secret_names & set(config.get("data", {})), config["metadata"]["name"]
    for obj in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "Job").values()]:
        container = pod_spec(obj)["containers"][0]
        assert {"secretRef": {"name": "aap-secrets"}} in container["envFrom"], obj["metadata"]["name"]
        for env in container.get("env", []):
            assert "value" not in env or env["name"] not in secret_names
    worker = pod_spec(by_kind(objects, "Deployment")["aap-worker"])["containers"][0]
    database = next(e for e in worker["env"] if e["name"] == "DATABASE_URL")
    assert database["valueFrom"]["secretKeyRef"] == {"name": "aap-secrets", "key": "AAP_WORKER_DATABASE_URL"}


def test_every_pod_runs_unprivileged():
    for obj in base_objects():
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        container = spec["containers"][0]["securityContext"]
        assert container == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
