"""The Python SDK: `Client`, its chat `Session`s, and the turn loop that moves both halves of the model one
turn at a time. The laptop's half of the model itself is `client.model`."""
