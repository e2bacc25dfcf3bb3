"""A draft head on the laptop (EAGLE-style): drafts from the model's own top-layer feature, and its training.

Drafting: `model.py` (the head's one decoder layer), `checkpoint.py` (the public EAGLE layout on disk),
`vocab.py` (the vocabulary drafts are read over), `drafter.py` (`DraftHead`, shared, and each session's
`HeadDrafter`). Training (`infemeral-client train-drafter`): `data.py` (the model's own answers and
features), `train.py` (the loss and the whole run), `measure.py` (the held-out measurement), `prompts.py`
and `settings.py` (which imports no torch, so the command line answers `--help` at once). Nothing is
imported here, so that reading the settings loads no torch.
"""
