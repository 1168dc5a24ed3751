"""Ordering inside components: children wait for whatever their component waits for.

Pulumi does not pass a component's ``depends_on`` down to the resources created inside
it, so a StatefulSet inside a component that "depends on" the namespace would still race
the namespace. Every component here builds its children's options with ``child_options``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi


def _as_list(depends_on: object) -> list[pulumi.Resource]:
    if depends_on is None:
        return []
    if isinstance(depends_on, pulumi.Resource):
        return [depends_on]
    if isinstance(depends_on, Sequence) and all(isinstance(r, pulumi.Resource) for r in depends_on):
        return list(depends_on)
    raise TypeError(
        f"depends_on must be a resource or a list of resources, got {type(depends_on).__name__}"
    )


def child_options(
    parent: pulumi.Resource,
    opts: pulumi.ResourceOptions | None,
    depends_on: Sequence[pulumi.Resource] = (),
) -> pulumi.ResourceOptions:
    """Options for a child of ``parent``: its parent, plus the component's and extra deps."""
    inherited = _as_list(opts.depends_on) if opts is not None else []
    return pulumi.ResourceOptions(parent=parent, depends_on=[*inherited, *depends_on])
