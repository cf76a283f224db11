"""The remote tier: KV chunks in a store shared by every instance and outliving them.

* :mod:`.url` parses ``remote_url`` (``lm://``, ``redis://``, ``rediss://``, ``redis-sentinel://``,
  ``redis-cluster://``) into a :class:`RemoteUrl`;
* :mod:`.store` is the interface every backend implements (:class:`RemoteStore`), and
  :mod:`.connect`'s ``open_store`` picks the backend for a URL;
* :mod:`.lm_store` / :mod:`.wire` / :mod:`.server` are our own single-box server
  (``lmcache_server``), its client and the protocol between them;
* :mod:`.redis_store` is Redis through redis-py (standalone, TLS, Sentinel, Cluster);
* :mod:`.tier` is what the storage manager drives: key naming by layout, a checksummed value
  frame, write-behind from the CPU tier and prefix fetches into the CPU pool.

Nothing here imports torch except :mod:`.tier` (``lmcache_server`` must run without it).
"""
