"""``lmcache_router``: an OpenAI-compatible HTTP proxy in front of vLLM engines that asks the
lmcache-p2p controller's ``POST /route`` where each request should go (docs/router.md).

* :mod:`lmcache_p2p.router.policies`: ``kv-aware``, ``round-robin``, ``least-loaded`` (pure);
* :mod:`lmcache_p2p.router.app`: the FastAPI app (:func:`create_app`), tokenizing, routing,
  forwarding with fallback, stats;
* :mod:`lmcache_p2p.router.config`: :class:`RouterConfig`, what the flags set;
* :mod:`lmcache_p2p.router.cli`: the ``lmcache_router`` command.

No torch and no vLLM: the router runs anywhere the engines' HTTP ports can be reached.
"""
