"""Facts about the outside world that the Pulumi program and the lab's tools both read: who
``pulumi up`` signs in as, the node-pool labels, the Blob CSI driver per AKS version, the images'
bases. Each module is pure and imports nothing of ours."""
