"""The OpenAI-compatible HTTP endpoint on the laptop (`infemeral-client serve`), docs/design.md §12.

`app.py` wires the routes; one serving object per endpoint (`serving_chat.py`, `serving_completion.py`,
`serving_models.py`) answers them, over a pool of live SDK sessions (`session_pool.py`).
"""
