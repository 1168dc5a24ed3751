"""The local lab: the elastic training story on one machine, with real etcd and torchrun."""
