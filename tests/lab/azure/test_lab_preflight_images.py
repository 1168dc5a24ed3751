"""``lab preflight``'s check of the Dockerfiles' bases, against a registry on loopback that
answers as Docker Hub does (``tests/support/registry_replay.py``, ``tests/recordings/registry``).

The registry API is the OCI distribution spec's (opencontainers/distribution-spec ``spec.md``:
``HEAD /v2/<name>/manifests/<reference>`` is 200 with ``Docker-Content-Digest``, or 404), reached
with Docker's token authentication (distribution/distribution ``docs/spec/auth/token.md``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catalog.base_images import parse_image_ref
from lab.azure.preflight.base_images import resolve, tags_page
from lab.azure.preflight.image_registry import MANIFEST_TYPES, Registry, RegistryError
from tests.support.azure_replay import FakeAzure
from tests.support.lab_azure_fixtures import _preflight
from tests.support.registry_replay import PYTHON, TORCH, FakeRegistry, recorded_tag, serve_registry

# No preflight here reaches Docker Hub: it answers from loopback.
pytestmark = pytest.mark.usefixtures("hub")

TORCH_PIN = "sha256:6acf597eeb8e376a96580dde4952f37cc017fef732bb40bfc73f28f25e3f64b4"
TORCH_REF = f"pytorch/pytorch:{TORCH[1]}@{TORCH_PIN}"
OTHER = "sha256:" + "f" * 64


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    yield from serve_registry()


def _torch(fake: FakeRegistry, **headers: str) -> dict[str, Any]:
    """The recorded torch tag, its headers changed; served for the tag alone."""
    answer = recorded_tag(*TORCH)
    answer["headers"] |= headers
    fake.manifests = {k: v for k, v in fake.manifests.items() if k[0] != TORCH[0]}
    fake.manifests[TORCH] = answer
    return answer


def _check(fake: FakeRegistry, text: str = TORCH_REF) -> Any:
    client = fake.client("registry-1.docker.io")
    return resolve(client, "base image Dockerfile", "Dockerfile", parse_image_ref(text))


@pytest.mark.usefixtures("processes")
def test_both_bases_resolve_anonymously_by_head_alone(
    azure: FakeAzure, hub: FakeRegistry, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys)
    assert code == 0
    # Both images are built on the same pinned slim Python (training/Dockerfile installs torch's
    # CUDA build on it).
    for dockerfile in ("Dockerfile", "Dockerfile.stager"):
        assert checks[f"base image {dockerfile}"]["detail"] == (
            f"python:{PYTHON[1]} exists; the tag names the pinned sha256:a36c24f9cbdf…; "
            "pulumi up imports it into the lab's registry (az acr import, by digest) and the "
            "build pulls it from there, not from Docker Hub"
        )
    # The spec's flow: a 401 challenge, a pull token for exactly that repository, the HEAD again.
    first, token, *_ = hub.seen
    assert (first.method, first.authorization) == ("HEAD", None)
    assert (token.path, token.query) == (
        "/token",
        {"scope": ["repository:library/python:pull"], "service": ["registry.docker.io"]},
    )
    heads = hub.requests("HEAD")
    assert {s.path for s in heads} == {f"/v2/library/python/manifests/{PYTHON[1]}"}
    assert all(set(s.accept.split(", ")) == set(MANIFEST_TYPES) for s in heads)
    # A HEAD is no pull against Docker Hub's limit, and nothing else was needed.
    assert {s.path for s in hub.requests("GET")} == {"/token"}


@pytest.mark.usefixtures("processes")
def test_a_missing_tag_fails_with_where_to_pick_another(
    azure: FakeAzure, hub: FakeRegistry, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    del hub.manifests[PYTHON]
    code, checks = _preflight(azure, capsys)
    assert code == 1
    check = checks["base image Dockerfile"]
    assert check["status"] == "fails"
    assert check["detail"] == (
        f"python:{PYTHON[1]}: no tag {PYTHON[1]} in library/python on Docker Hub"
    )
    assert "https://hub.docker.com/_/python/tags" in check["fix"]
    assert "training/Dockerfile" in check["fix"]
    assert checks["base image Dockerfile.stager"]["status"] == "fails"


def test_a_pin_that_is_the_tags_linux_amd64_image_passes_with_one_get(
    registry: FakeRegistry,
) -> None:
    answer = _torch(registry, **{"Docker-Content-Digest": OTHER})
    answer["body"]["manifests"][0]["digest"] = TORCH_PIN
    check = _check(registry)
    assert (check.status, check.detail) == (
        "ok",
        f"pytorch/pytorch:{TORCH[1]} exists; the pinned sha256:6acf597eeb8e… is its linux/amd64 "
        "image",
    )
    assert [s.path for s in registry.requests("GET")][-1].endswith(f"/manifests/{TORCH[1]}")


def test_a_pin_of_another_platform_fails(registry: FakeRegistry) -> None:
    answer = _torch(registry, **{"Docker-Content-Digest": OTHER})
    answer["body"]["manifests"][0] |= {"digest": TORCH_PIN}
    answer["body"]["manifests"][0]["platform"] = {"architecture": "arm64", "os": "linux"}
    check = _check(registry)
    assert check.status == "fails"
    assert "is the tag's linux/arm64 image; AKS runs linux/amd64" in check.detail


def test_a_tag_that_moved_warns_while_the_pin_exists_and_fails_once_it_is_gone(
    registry: FakeRegistry,
) -> None:
    _torch(registry, **{"Docker-Content-Digest": OTHER})
    registry.manifests[(TORCH[0], TORCH_PIN)] = recorded_tag(*TORCH)
    check = _check(registry)
    assert check.status == "warning"
    assert check.detail.endswith("not the pinned sha256:6acf597eeb8e…, which still exists")
    del registry.manifests[(TORCH[0], TORCH_PIN)]
    check = _check(registry)
    assert check.status == "fails"
    assert "which is gone from pytorch/pytorch" in check.detail
    assert OTHER in check.fix


def test_a_registry_that_sends_no_digest_header_is_hashed(registry: FakeRegistry) -> None:
    # Docker-Content-Digest is optional (spec.md, "Legacy Docker support HTTP headers"): the
    # digest is then the sha256 of the manifest's bytes, as served.
    answer = _torch(registry)
    del answer["headers"]["Docker-Content-Digest"]
    served = json.dumps(answer["body"]).encode()
    head = registry.client("registry-1.docker.io").head(*TORCH)
    assert head is not None and head.digest == f"sha256:{hashlib.sha256(served).hexdigest()}"


def test_an_unpinned_base_warns_with_the_digest_to_pin(registry: FakeRegistry) -> None:
    check = _check(registry, f"pytorch/pytorch:{TORCH[1]}")
    assert check.status == "warning"
    assert check.fix == f"pin it: FROM pytorch/pytorch:{TORCH[1]}@{TORCH_PIN}"


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (401, "refused anonymous access to library/python (401): it does not exist, or it is"),
        (429, "limits anonymous requests and refused this one (429); try again later"),
        (503, "Docker Hub answered 503 for library/python"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_a_refusing_registry_is_one_line_for_that_base(
    status: int,
    message: str,
    azure: FakeAzure,
    hub: FakeRegistry,
    tools: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hub.refused[PYTHON[0]] = status
    code, checks = _preflight(azure, capsys)
    assert code == 1
    for dockerfile in ("Dockerfile", "Dockerfile.stager"):
        check = checks[f"base image {dockerfile}"]
        assert check["status"] == "fails" and message in check["detail"]
        assert "\n" not in check["detail"]


@pytest.mark.usefixtures("processes")
def test_an_unreachable_registry_is_one_line_naming_what_was_not_checked(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = Registry("http://127.0.0.1:9", "Hub")  # discard port: nothing listens
    code, checks = _preflight(azure, capsys, registry=lambda host: closed)
    assert code == 1
    assert checks["registry Hub"]["detail"] == (
        f"cannot reach Hub (127.0.0.1): Connection refused; not checked: python:{PYTHON[1]}"
    )
    assert "base image Dockerfile" not in checks
    assert checks["ACR Tasks"]["status"] == "ok"  # Azure's checks are not held up


def test_the_token_may_come_as_access_token_and_a_bad_token_service_is_named(
    registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = registry.client("registry-1.docker.io")
    token = {"access_token": registry.token, "expires_in": 300}
    monkeypatch.setattr("tests.support.registry_replay.registry_recording", lambda name: token)
    assert client.head(*TORCH) is not None
    monkeypatch.setattr("tests.support.registry_replay.registry_recording", lambda name: {})
    with pytest.raises(RegistryError, match="Docker Hub's token service sent no token"):
        registry.client("registry-1.docker.io").head(*TORCH)


def test_where_the_tags_are_shown() -> None:
    assert tags_page(parse_image_ref("python:3.11")) == "https://hub.docker.com/_/python/tags"
    assert tags_page(parse_image_ref("ghcr.io/a/b:1")) == "ghcr.io/a/b"
