"""Where encrypted sessions are kept: the storage interface (`base.py`), its backends, and `open_store`."""
