"""``python -m bench rendezvous-scale``: N rendezvous agents against one etcd 3.5, then a model.

``agents`` hosts the training's handlers in spawned worker processes, ``runner`` times each
node count's rounds against them, ``etcd_metrics`` reads what etcd did, ``tables`` sums the
runs up into rows and fits ``model`` (pure) beyond the largest N, ``command`` is the CLI.
"""
