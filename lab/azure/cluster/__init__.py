"""The job on AKS: ``lab watch`` follows it, ``lab drill`` evicts Spot nodes under it.

``kube`` reaches the cluster (the stack outputs, the sign-in, the job's state),
``job_watcher`` streams its pods, logs and events, ``recorder`` turns them into the records
and files the report reads, ``event_lines`` says which events the user sees and how, and
``cloud_run`` is the two commands.
"""
