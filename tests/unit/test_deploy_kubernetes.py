"""deploy/kubernetes/: the manifests are valid Kubernetes objects (kubernetes-validate, offline, strict) and say what
this server needs: readiness on /health, liveness and start-up that do not kill a replica whose agents restart or
warm up, a termination grace longer than the server's own, Prometheus scraping, a Service that selects the pods,
an HPA on a metric the server exports, and arguments the CLI and the config accept."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from llm_serving.config import config_from_dict, parse_override

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                                                                        "(pip install kubernetes-validate)")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs() -> dict:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_every_manifest_is_a_valid_kubernetes_object():
    docs = _docs()
    assert {kind for kind, _ in docs} == {"Deployment", "PersistentVolumeClaim", "Service", "HorizontalPodAutoscaler"}
    for (kind, name), doc in docs.items():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)          # raises with the offending field


def test_the_deployment_probes_grace_and_arguments_fit_the_server():
    docs = _docs()
    pod = docs[("Deployment", "llm-serving")]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("livenessProbe", "startupProbe"):                     # never /health: a 503 there is not death
        assert "tcpSocket" in container[probe] and "httpGet" not in container[probe]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # a cold start (90 s measured) fits
    args = container["args"]
    assert args[0] == "start"
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--model")
    parsed = parser.parse_args(args[1:])
    config = config_from_dict({}, [parse_override(s) for s in parsed.set])
    port = container["ports"][0]["containerPort"]
    assert parsed.port == port and config.serving_config.server_ip == "0.0.0.0"
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.serving_config.shutdown_grace_s
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == port
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in docs


def test_the_service_and_the_autoscaler_point_at_the_deployment():
    docs = _docs()
    deployment = docs[("Deployment", "llm-serving")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = docs[("Service", "llm-serving")]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    hpa = docs[("HorizontalPodAutoscaler", "llm-serving")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-serving"
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    source = (Path(__file__).resolve().parents[2] / "llm_serving" / "server" / "metrics.py").read_text()
    assert name.startswith("llm_serving_") and f'"{name[len("llm_serving_"):]}"' in source   # the server exports it
