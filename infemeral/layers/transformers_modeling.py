"""transformers' modeling code, imported without hqq and with infemeral's cache attention registered.

transformers imports hqq whenever it is installed (for a quantised KV cache
that infemeral never uses), and hqq's class bodies call `torch.compile`, which
imports torch's compiler stack: 1 to 2.5 s more on every start of a client, an
endpoint or a server wherever `infemeral[quant]` is installed. infemeral's own
use of hqq (`quant/hqq.py`) imports it directly and is unaffected; only
transformers' `HQQQuantizedCache` is then unavailable in this process.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def _hqq_hidden_from_transformers():
    import transformers.utils as utils

    found = utils.is_hqq_available
    utils.is_hqq_available = lambda *args, **kwargs: False
    try:
        yield
    finally:
        utils.is_hqq_available = found


if "transformers.cache_utils" not in sys.modules:
    with _hqq_hidden_from_transformers():
        import transformers.cache_utils  # noqa: F401

from transformers import AttentionInterface  # noqa: E402

from infemeral.layers.attention import NAME, cache_attention  # noqa: E402

AttentionInterface.register(NAME, cache_attention)
