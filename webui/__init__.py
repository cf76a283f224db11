"""The controller's dashboard (installed as ``lmcache_p2p.webui``): jinja2 templates and static
files, no CDN. Built in the WebUI issue."""
