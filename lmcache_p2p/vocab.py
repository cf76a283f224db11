"""Names shared across the package, with no imports: any module may use them without pulling in
the one that happens to act on them.

Hit sources: where the KV of a loaded chunk came from. The values are vLLM's ``CacheHitSource``
values (``vllm:prompt_tokens_cached_by_source{source=...}``), ordered nearest the GPU first:

* ``device``: our GPU tier (a copy beside vLLM's blocks, in the same GPU);
* ``host``: our CPU pool;
* ``p2p``: pulled from a peer for this request;
* ``disk``: our disk tier;
* ``external_unspecified``: the remote store (lmcache_server, Redis).
"""

SOURCE_DEVICE = "device"
SOURCE_HOST = "host"
SOURCE_P2P = "p2p"
SOURCE_DISK = "disk"
SOURCE_REMOTE = "external_unspecified"
HIT_SOURCES = (SOURCE_DEVICE, SOURCE_HOST, SOURCE_P2P, SOURCE_DISK, SOURCE_REMOTE)
