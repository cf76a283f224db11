"""The LoRA adapters a rank's engine has served, as the controller learns them.

The controller keys a request that names an adapter (``/lookup``, ``/route`` with ``lora``) as
the engines do, with the adapter's ``lora_id`` (adapter_id.py), which only an engine can compute:
it has the files. So each rank reports name -> lora_id: the whole map with every Register, and
again with a heartbeat whenever it changed since that controller last answered one (each
controller link keeps its own mark: with several controllers each learns the map).

At most :data:`MAX_ADAPTERS` names are kept, the least recently served dropped first (the
controller bounds the map the same way).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_ADAPTERS = 64


class ServedAdapters:
    """name -> lora_id of the adapters served lately, and a version that changes with it."""

    def __init__(self, capacity: int = MAX_ADAPTERS):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._ids: OrderedDict[str, str] = OrderedDict()
        self.version = 0

    def note(self, name: str, lora_id: str) -> bool:
        """Adapter ``name`` was served with ``lora_id``; True when that changed the map."""
        with self._lock:
            known = self._ids.get(name)
            self._ids[name] = lora_id
            self._ids.move_to_end(name)
            if known == lora_id:
                return False
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
            self.version += 1
            return True

    def snapshot(self) -> tuple[int, dict[str, str]]:
        with self._lock:
            return self.version, dict(self._ids)
