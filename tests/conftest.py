import os
import sys

# Test helpers (protocol_client) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
