"""The agents' own store: torch's ``RendezvousInfo.store``, on etcd's v3 API.

torch's agent uses it only to wait for the other agents at the end (``_exit_barrier``: ``add``,
``set``, ``wait`` in ``torch/distributed/elastic/utils/store.py``) and, without
``TORCH_ELASTIC_WORKER_IDENTICAL``, to hand out worker ranks (``set``, ``get``, ``multi_get``,
``multi_set``). It is not rank 0's TCPStore: a TCPStore client waits without bound on a server
whose process is stopped (measured, torch 2.13: an ``add`` to a SIGSTOPped server never
returned), and an agent must not hang on a frozen peer. Here every call is an etcd request
with its own timeout, and a wait is a watch bounded by the store's timeout.

Values are kept as hex: the gateway's JSON carries strings, a store's values are bytes.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

from torch.distributed import Store

from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Backoff, Etcd, EtcdError

__all__ = ["AgentStore", "StoreTimeout"]


class StoreTimeout(RuntimeError):
    """The keys a ``wait`` asked for did not all appear within the store's timeout."""


def _text(value: str | bytes) -> str:
    return (value.encode() if isinstance(value, str) else bytes(value)).hex()


class AgentStore(Store):
    """Keys under ``prefix`` (one per round) on etcd."""

    def __init__(self, client: Etcd, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self._client, self._prefix = client, prefix.rstrip("/") + "/"
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self._client.txn([], [etcd_v3.put(self._key(key), _text(value))])

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._client.get(self._key(key))
        assert kv is not None  # keys are never deleted while a round's agents use them
        return bytes.fromhex(kv.value)

    def add(self, key: str, value: int) -> int:
        """Add atomically: a transaction on the key's revision, retried when it lost a race."""
        full = self._key(key)
        while True:
            kv = self._client.get(full)
            now = int(bytes.fromhex(kv.value)) if kv else 0
            compare = etcd_v3.mod_revision_is(full, kv.mod_revision) if kv else etcd_v3.absent(full)
            if self._client.txn([compare], [etcd_v3.put(full, _text(str(now + value)))])[0]:
                return now + value

    def check(self, keys: Sequence[str]) -> bool:
        present = {kv.key for kv in self._client.range(self._prefix)[0]}
        return all(self._key(k) in present for k in keys)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists: a watch from the revision of each read, not a poll; a
        failed watch is watched again after a backoff (etcd_v3.py)."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        backoff = Backoff()
        while True:
            kvs, revision = self._client.range(self._prefix)
            present = {kv.key for kv in kvs}
            if all(self._key(k) in present for k in keys):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"keys {list(keys)} not set within {limit:g} s")
            try:
                self._client.wait(self._prefix, revision, left)
                backoff.reset()
            except EtcdError:
                time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._client.txn(
            [], [etcd_v3.put(self._key(k), _text(v)) for k, v in zip(keys, values, strict=True)]
        )

    def delete_key(self, key: str) -> bool:
        self._client.delete(self._key(key))
        return True

    def num_keys(self) -> int:
        return len(self._client.range(self._prefix)[0])
