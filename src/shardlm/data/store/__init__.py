"""The token store: a corpus tokenised once, offline and in parallel, that every rank memory-maps.

- `format`: the store on disk (files, manifest, checksums): `TokenStore.open`, and writing one from parts.
- `prepare`: the preparation job (`prepare(spec, out)`): input units -> worker processes -> parts -> a store.
- `cache`: raw data.path files prepared once per content into the data cache (`cached_store`, its lock).

Opening a store needs only the names below; the others are imported from their module.
"""

from shardlm.data.store.format import MANIFEST, STORE_PREFIX, TokenStore, is_store, store_path

__all__ = ["MANIFEST", "STORE_PREFIX", "TokenStore", "is_store", "store_path"]
