"""Pure builders of the lab's Kubernetes objects: plain dicts in, plain dicts out.

Nothing here imports pulumi or kubernetes or does I/O, so the same builders serve the
Pulumi components (``workloads/*.py``), the tests and the local lab.
"""
