"""Check that the images ``pulumi up`` builds have their bases: each Dockerfile's ``FROM`` resolves
in its registry, under its tag and its pinned digest, anonymously, as the import into the lab's
registry pulls it, and say where the build pulls it from (the lab's registry).

A missing tag otherwise fails ``pulumi up`` inside ``az acr build``, minutes in, after the
cluster and the registry exist. The bases and their pins come from the Dockerfiles
(``catalog/base_images.py``); the registry calls are in ``image_registry.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from catalog.base_images import DOCKER_HUB, ImageRef, training_base_images
from lab.azure.preflight.context import FAILS, OK, WARNING, Check, Context
from lab.azure.preflight.image_registry import Registry, RegistryError

AKS_PLATFORM = "linux/amd64"
"""What AKS's nodes run, and what the image build targets (``--platform linux/amd64``)."""


def check_base_images(ctx: Context) -> Iterator[Check]:
    """One line per base image; one line per registry that cannot be reached."""
    try:
        bases = training_base_images(ctx.training_dir)
    except (OSError, ValueError) as err:
        yield Check("base images", FAILS, f"cannot read the Dockerfiles' FROM lines: {err}")
        return
    by_registry: dict[str, list[tuple[str, str, ImageRef]]] = {}
    for dockerfile, refs in bases.items():
        for index, ref in enumerate(refs):
            name = f"base image {dockerfile}" + (f" #{index + 1}" if len(refs) > 1 else "")
            by_registry.setdefault(ref.registry, []).append((name, dockerfile, ref))
    for host, entries in by_registry.items():
        registry = ctx.registry(host)
        try:
            registry.probe()
        except RegistryError as err:
            # Each base once: both images may be built on the same one.
            names = ", ".join(dict.fromkeys(_named(ref) for _, _, ref in entries))
            fix = "the image build pulls them from there too: check the network (or HTTPS_PROXY)"
            yield Check(f"registry {registry.label}", FAILS, f"{err}; not checked: {names}", fix)
            continue
        for name, dockerfile, ref in entries:
            try:
                yield _where_built(resolve(registry, name, dockerfile, ref), ref)
            except RegistryError as err:
                yield Check(name, FAILS, f"{_named(ref)}: {err}")


IMPORTED = (
    "pulumi up imports it into the lab's registry (az acr import, by digest) and the build pulls "
    "it from there, not from Docker Hub"
)


def _where_built(check: Check, ref: ImageRef) -> Check:
    """Which registry the build pulls ``ref`` from, on a line that found it."""
    if not ref.imported or check.status == FAILS:
        return check
    return replace(check, detail=f"{check.detail}; {IMPORTED}")


def resolve(registry: Registry, name: str, dockerfile: str, ref: ImageRef) -> Check:
    """Whether ``ref``'s tag exists and names its pinned digest (itself or one of its images)."""
    head = registry.head(ref.repository, ref.tag)
    where = f"{ref.repository} on {registry.label}"
    if head is None:
        fix = (
            f"pick a tag that exists ({tags_page(ref)}) and pin it with its digest in "
            f"training/{dockerfile} (docs/pins.md says why each base)"
        )
        return Check(name, FAILS, f"{_named(ref)}: no tag {ref.tag} in {where}", fix)
    if not ref.digest:
        fix = f"pin it: FROM {_named(ref)}@{head.digest}"
        return Check(name, WARNING, f"{_named(ref)} exists ({head.digest}), not pinned", fix)
    if head.digest == ref.digest:
        return Check(name, OK, f"{_named(ref)} exists; the tag names the pinned {_short(ref)}")
    if head.is_index:
        listed = registry.get(ref.repository, ref.tag).get("manifests") or []
        found = next((m for m in listed if m.get("digest") == ref.digest), None)
        if found is not None:
            return _platform_check(name, ref, found)
    return _moved(registry, name, ref, head.digest)


def _platform_check(name: str, ref: ImageRef, manifest: dict) -> Check:
    platform = manifest.get("platform") or {}
    text = "/".join(p for p in (platform.get("os"), platform.get("architecture")) if p)
    if text != AKS_PLATFORM:
        fix = f"pin the tag's {AKS_PLATFORM} image or the tag's index digest"
        why = f"the pinned {_short(ref)} is the tag's {text or 'unknown'} image"
        return Check(name, FAILS, f"{_named(ref)}: {why}; AKS runs {AKS_PLATFORM}", fix)
    return Check(name, OK, f"{_named(ref)} exists; the pinned {_short(ref)} is its {text} image")


def _moved(registry: Registry, name: str, ref: ImageRef, now: str) -> Check:
    """The tag names another digest than the pin: the build pulls the pin, if it still exists."""
    moved = f"{_named(ref)} now names {now[:19]}…, not the pinned {_short(ref)}"
    if registry.head(ref.repository, ref.digest) is None:
        fix = f"pin what the tag names now (FROM {_named(ref)}@{now}) and check it (docs/pins.md)"
        return Check(name, FAILS, f"{moved}, which is gone from {ref.repository}", fix)
    fix = f"the build uses the pin; to follow the tag, pin {now} (docs/pins.md)"
    return Check(name, WARNING, f"{moved}, which still exists", fix)


def tags_page(ref: ImageRef) -> str:
    """Where a person sees the repository's tags."""
    if ref.registry != DOCKER_HUB:
        return f"{ref.registry}/{ref.repository}"
    if ref.repository.startswith("library/"):
        return f"https://hub.docker.com/_/{ref.repository.removeprefix('library/')}/tags"
    return f"https://hub.docker.com/r/{ref.repository}/tags"


def _named(ref: ImageRef) -> str:
    """The reference as written after FROM, without the digest."""
    return ref.reference.partition("@")[0]


def _short(ref: ImageRef) -> str:
    return f"{ref.digest[:19]}…"
