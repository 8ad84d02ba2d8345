"""Data store for large notebook objects: content-addressed, checksummed, streamed, cached.

store = await open_datastore(config)           # [datastore] backend = local | s3 | redis
ref = await store.put(buffer)                  # or put_stream(chunks, size_hint=...)
view = await store.get(ref)                    # verified; CorruptObject otherwise
"""

from shared.datastore.base import DEFAULT_CACHE_BYTES, DEFAULT_CHUNK_BYTES, DataStore, ObjectRef
from shared.datastore.errors import CorruptObject, DataStoreError, DataStoreUnavailable, ObjectNotFound
from shared.datastore.factory import BACKENDS, open_datastore

__all__ = [
    "BACKENDS",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "CorruptObject",
    "DataStore",
    "DataStoreError",
    "DataStoreUnavailable",
    "ObjectNotFound",
    "ObjectRef",
    "open_datastore",
]
