"""The built-in prompt the audit attacks when the user gives none, and the second session it links against."""

from __future__ import annotations

# A chat message with the kinds of secret people paste into assistants: an SSN, a password,
# a diagnosis and a card number (all made up; 4111 1111 1111 1111 is a well-known test card).
DEFAULT_PROMPT = ("My SSN is 078-05-1120, my password is Tr0ub4dor&3, I was diagnosed with HIV "
                  "and my card is 4111 1111 1111 1111.")

# The second session the Gram-linking observer compares with: the same text sent again, in a new session,
# after an unrelated first exchange (so at other positions and in another context).
EARLIER_EXCHANGE = [
    {"role": "user", "content": "What is a good name for a cat?"},
    {"role": "assistant", "content": "Try Miso."},
]
