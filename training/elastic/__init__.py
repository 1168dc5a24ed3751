"""Elastic membership, as torch's own ``torch.distributed.elastic`` keeps it: the launch settings
the cluster and the lab share (``launch``), the rendezvous (its pure ``rounds``, its etcd
``membership``, the ``liveness`` probe and failure detector), how a worker learns of a fault
(``faults``) and how a node ends (``exit_codes``). Imports nothing else of ``training``."""
