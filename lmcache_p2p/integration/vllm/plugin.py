"""vLLM general plugin: the connector name ``LMCacheConnectorV1`` resolves to lmcache-p2p.

Installing lmcache-p2p registers :func:`register` under the entry point group
``vllm.general_plugins``. vLLM calls every plugin of that group in each of its processes (the API
server, the engine core, every worker, Ray actors included) before it looks a connector up, so
a seed's unedited

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'

builds our :class:`~lmcache_p2p.integration.vllm.connector.LMCacheConnectorV1` instead of vLLM's
built-in one, which imports the original ``lmcache`` package.

Which implementation the name resolves to, decided once per process:

* ``LMC_P2P_CONNECTOR`` unset, empty or ``auto``: ours when the original ``lmcache`` package is
  not installed; vLLM's built-in one when it is (installing LMCache is a choice we respect).
* ``LMC_P2P_CONNECTOR=p2p``: ours, whether ``lmcache`` is installed or not.
* ``LMC_P2P_CONNECTOR=lmcache``: vLLM's built-in one, whether ``lmcache`` is installed or not.
* Any other value: one ERROR line, and vLLM's built-in one (the plugin never stops vLLM).

The variable is outside the ``LMCACHE_*`` namespace because the connector reads every
``LMCACHE_*`` variable as a configuration key, and outside ``VLLM_*`` because vLLM warns about
(or, with ``--fail-on-environ-validation``, refuses to start on) ``VLLM_*`` names it does not know.

``"kv_connector_module_path": "lmcache_p2p.integration.vllm"`` still selects ours whatever this
plugin decided: vLLM resolves a module path before its registry. Setting ``VLLM_PLUGINS`` to a
list without ``lmcache_p2p`` keeps this plugin from running at all.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

SWITCH_ENV = "LMC_P2P_CONNECTOR"
AUTO, P2P, LMCACHE = "auto", "p2p", "lmcache"
CHOICES = (AUTO, P2P, LMCACHE)

CONNECTOR_NAME = "LMCacheConnectorV1"
OUR_MODULE = "lmcache_p2p.integration.vllm.connector"
OUR_CLASS = "LMCacheConnectorV1"

# What this process decided ("p2p", "builtin" or "error"); None until register() first ran.
# vLLM guards load_general_plugins() with its own flag, but it documents that plugins may run more
# than once (and tests or other plugins may call register() directly): this keeps the registry
# change and the log line to one per process. A forked child inherits both the flag and the
# registry it describes, so it has nothing to redo.
_decision: str | None = None


def _original_lmcache_origin() -> str | None:
    """Where the original ``lmcache`` package is, or None when it is not installed. Found without
    importing it: importing LMCache would pull in torch and its CUDA extensions in every process."""
    try:
        spec = importlib.util.find_spec("lmcache")
    except (ImportError, ValueError):  # a broken install, or a module object without __spec__
        return None
    # A bare "lmcache/" directory on sys.path (the working directory, a checkout) is a namespace
    # package: no origin, nothing LMCache could run from. Only a real package counts.
    if spec is None or spec.origin is None or spec.loader is None:
        return None
    return spec.origin


def _point_name_at_ours() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector() is vLLM's public way to add a connector, but it raises ValueError for a
    # name already registered, and vLLM registers LMCacheConnectorV1 itself when the factory module
    # is imported (factory.py, the same in 0.25.1 and 0.27.1); there is no public way to replace
    # or remove an entry. So the built-in entry is dropped from the registry dict and the name
    # registered again through register_connector(), which builds the lazy loader the way this
    # vLLM expects: our connector module (and torch with it) is imported only when an engine
    # actually asks for the class. Should registering fail, the built-in entry is put back.
    registry = KVConnectorFactory._registry
    previous = registry.pop(CONNECTOR_NAME, None)
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, OUR_MODULE, OUR_CLASS)
    except BaseException:
        if previous is not None:
            registry[CONNECTOR_NAME] = previous
        raise


def _decide() -> str:
    raw = os.environ.get(SWITCH_ENV, "")
    choice = raw.strip().lower() or AUTO
    ours = f"lmcache-p2p ({OUR_MODULE}.{OUR_CLASS})"
    builtin = "vLLM's built-in connector (the original LMCache)"
    if choice not in CHOICES:
        logger.error(
            "%s=%r is not one of %s; %s resolves to %s",
            SWITCH_ENV,
            raw,
            ", ".join(CHOICES),
            CONNECTOR_NAME,
            builtin,
        )
        return "error"

    origin = _original_lmcache_origin()
    if choice == LMCACHE or (choice == AUTO and origin is not None):
        if choice == LMCACHE:
            why = f"{SWITCH_ENV}=lmcache"
            if origin is None:
                why += ", though the lmcache package is not installed: an engine using it will fail to start"
        else:
            why = f"the original lmcache package is installed ({origin}); {SWITCH_ENV}=p2p selects lmcache-p2p"
        logger.info("%s resolves to %s: %s", CONNECTOR_NAME, builtin, why)
        return "builtin"

    _point_name_at_ours()
    if choice == P2P:
        why = f"{SWITCH_ENV}=p2p" + (f" (the original lmcache package at {origin} is not used)" if origin else "")
    else:
        why = f"the original lmcache package is not installed; {SWITCH_ENV}=lmcache keeps vLLM's built-in one"
    logger.info("%s resolves to %s: %s", CONNECTOR_NAME, ours, why)
    return "p2p"


def _register_blend_model() -> None:
    """With ``enable_blending`` in this process's lmcache-p2p configuration, vLLM builds the models
    blending supports (Llama, Qwen2, Qwen3) through classes that let the connector reach them
    (blend_model.py). A configuration that does not load is left to the connector, which names the
    bad key when it starts."""
    from lmcache_p2p.config import ConfigError, LMCacheConfig

    try:
        enabled = LMCacheConfig.load().enable_blending
    except ConfigError:
        return
    if not enabled:
        return
    from vllm import ModelRegistry

    from lmcache_p2p.blend.support import SUPPORTED

    for architecture in SUPPORTED:
        ModelRegistry.register_model(architecture, f"lmcache_p2p.integration.vllm.blend_model:{architecture}")
    logger.info("enable_blending: %s built by lmcache_p2p.integration.vllm.blend_model", ", ".join(SUPPORTED))


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Cheap (it imports vLLM's connector factory, never
    our connector nor LMCache), idempotent, and never raises: vLLM calls general plugins without
    catching their errors, and a failure here must not take the engine down."""
    global _decision
    if _decision is not None:
        return
    try:
        # Our logger writes to stderr even though vLLM configures only the ``vllm`` loggers; a
        # stdlib-only module, cheap to import in every process.
        from lmcache_p2p import logs

        logs.ensure_handler()
        _decision = _decide()
        if _decision == "p2p":
            _register_blend_model()
    except Exception:
        _decision = "error"
        logger.exception(
            "lmcache-p2p could not register %s with vLLM; %s keeps vLLM's built-in one "
            '(add "kv_connector_module_path": "lmcache_p2p.integration.vllm" to use lmcache-p2p)',
            CONNECTOR_NAME,
            CONNECTOR_NAME,
        )
