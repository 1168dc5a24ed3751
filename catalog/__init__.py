"""Facts about the outside world that the stack's config, the Pulumi program and the lab's tools
read: the GPU sizes, Azure's name limits, who ``pulumi up`` signs in as, the node pools' names and
labels, the Blob CSI driver per AKS version and what an image's build context holds.
Each module is pure and imports nothing of ours."""
