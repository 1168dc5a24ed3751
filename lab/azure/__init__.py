"""The user's tools around a real run on Azure: the sign-in and clients, checks before
spending (``preflight``), prices and eviction rates, evicting a Spot node, and following the
job on the cluster (``watch``, ``drill``, ``rebalance``). May import ``lab.live`` and
``lab.report``; never ``lab.local``."""
