"""Build the configured data store from the ``[datastore]`` section."""

from __future__ import annotations

from pathlib import Path

from shared.config import Config, ConfigError
from shared.datastore.base import DataStore

BACKENDS = ("local", "s3", "redis")


async def open_datastore(config: Config) -> DataStore:
    """Open ``datastore.backend`` with its keys; ``ConfigError`` for an unknown backend,
    ``DataStoreUnavailable`` for a service that cannot be reached (naming its address)."""
    section = config["datastore"]
    backend = section["backend"]
    common = {"chunk_bytes": section["chunk_bytes"], "cache_bytes": section["cache_bytes"]}
    if backend == "local":
        from shared.datastore.local_backend import LocalStore

        path = Path(section["path"]).expanduser() if section["path"] else config.state_dir() / "datastore"
        return LocalStore(path, **common)
    if backend == "s3":
        from shared.datastore.s3_backend import S3Store

        return await S3Store.open(section["bucket"], endpoint_url=section["endpoint_url"] or None, **common)
    if backend == "redis":
        from shared.datastore.redis_backend import RedisStore

        return await RedisStore.open(section["url"], **common)
    raise ConfigError(f"datastore.backend: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
