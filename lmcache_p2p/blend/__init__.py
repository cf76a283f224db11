"""Non-prefix KV reuse (CacheBlend, issue 23): segments keyed by their own tokens
(:mod:`.segments`), cached keys moved to new positions (:mod:`.rope`), and the blend that fixes
up reused KV by recomputing a few tokens per layer (:mod:`.blender`) through a model family's
adapter (:mod:`.models`)."""
