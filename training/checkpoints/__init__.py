"""Checkpoints and their stores: the commit protocol (``checkpoint``), its records
(``manifest``) and bytes (``serialization``), the store's history (``lineage``), where the ranks
resume (``resume``), a directory or Azure Blob behind one interface (``storage``,
``blob_store``, ``blob_location``) and the hard deadline of an eviction's save. Imports nothing
else of ``training``."""
