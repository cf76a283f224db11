"""The per-rank worker (installed as ``lmcache_p2p.worker``): registers with the controller,
forwards the StorageManager's admit/evict events, heartbeats, executes commands, and serves
peer pulls. Built in the Worker/P2P issue."""
