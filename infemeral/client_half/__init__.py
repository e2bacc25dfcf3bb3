"""The laptop's half of the model: embedding, the first decoder layer(s), the secret basis, final norm and LM
head, in the dtype, on the device and with the weights (dense, packed bf16, int8) the laptop runs best."""
