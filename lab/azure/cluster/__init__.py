"""The job on AKS: ``lab watch`` follows it, ``lab drill`` evicts Spot nodes under it, ``lab
rebalance`` moves its workers from on-demand nodes back to Spot.

``kube`` reaches the cluster (the stack outputs, the sign-in, the job's state), ``drain`` is
the one write (cordon a node, evict a pod), ``job_watcher`` streams pods, logs and events,
``recorder`` turns them into the records and files the report reads, ``event_lines`` and
``capacity_lines`` say which events the user sees and how, ``follow`` is what the commands
share, ``gpu_nodes`` decides which worker moves, ``cloud_run`` and ``rebalance`` are the
commands and ``command`` their flags.
"""
