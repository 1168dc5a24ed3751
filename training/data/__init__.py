"""The data: CIFAR-10 in its binary format (``cifar10``), which samples each rank takes at each
step (``sampler``), the staging Job's program (``stage_data``) and the copy to node-local disk
at pod start (``fetch_data``). May import ``training.elastic`` (its env names) and
``training.checkpoints`` (the stores)."""
