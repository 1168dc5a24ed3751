"""The local lab: etcd, torchrun nodes as process trees, scenarios of faults, the runner that
injects them and the session that sets it all up and always cleans it up. May import
``lab.live`` and ``lab.report``; never ``lab.azure``."""
