"""``python -m lab preflight``: will ``pulumi up`` work, before it creates and bills anything?

The checks, by subject, each a module: ``machine`` (the tools and az's login),
``subscription`` (which one, its providers, ACR Tasks for its offer), ``identity`` (the
sign-in and its roles), ``region`` (VM sizes and vCPU quotas). ``context`` holds what they
share; ``command`` runs them in order and prints them. A new check joins the module of its
subject, or a new module for a new subject, and its place in ``command.AZURE_CHECKS``.
"""
