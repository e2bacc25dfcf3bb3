"""The cloak: the secret basis, folding norm gains and rotating layers into it, and the bundles `prepare`
writes from a model."""
