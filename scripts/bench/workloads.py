"""Prompts for the speculation benchmark: four workloads, from "the answer is in the prompt" to open chat.

copy      — repeat a given passage (prompt lookup should draft almost everything)
document  — answer by quoting or summarising a given document (RAG-like)
code      — rewrite a given snippet with a small change
chat      — open questions whose answers are not in the prompt

The passages are either public domain (King James Version, 1611) or written
for this benchmark.
"""

from __future__ import annotations

COPY_PASSAGES = [
    "And Joseph dreamed a dream, and he told it his brethren: and they hated him yet the more. And he said unto "
    "them, Hear, I pray you, this dream which I have dreamed: For, behold, we were binding sheaves in the field, "
    "and, lo, my sheaf arose, and also stood upright; and, behold, your sheaves stood round about, and made "
    "obeisance to my sheaf.",
    "The lighthouse keeper climbed the spiral stairs every evening at six. He trimmed the wick, polished the great "
    "lens until it shone, and wrote the weather in a leather book: wind from the west, sea calm, two ships passing "
    "north. In forty years he never missed a night, and no ship was ever lost on his rocks.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried yeast. Add three "
    "hundred and fifty millilitres of warm water and knead the dough for ten minutes until it is smooth. Leave it "
    "to rise for an hour, shape it into a loaf, and bake it at two hundred and twenty degrees for thirty minutes.",
    "The committee met on Tuesday and agreed on three points. First, the library will open an hour earlier on "
    "weekdays. Second, the reading room will be quiet at all times. Third, members may borrow up to six books at "
    "once, and each loan lasts three weeks unless someone else has asked for the book.",
    "Now the serpent was more subtil than any beast of the field which the LORD God had made. And he said unto the "
    "woman, Yea, hath God said, Ye shall not eat of every tree of the garden? And the woman said unto the serpent, "
    "We may eat of the fruit of the trees of the garden.",
]

COPY_PROMPTS = [f"Repeat the following passage exactly, word for word:\n\n{p}" for p in COPY_PASSAGES]

DOCUMENT = {
    "harbour": "Port Alder is a small harbour town on the north coast. It was founded in 1742 by fishermen from "
               "the islands, who built the stone quay that still stands today. The town's main industry was "
               "herring fishing until 1910, when the herring disappeared from the bay. After that, the town "
               "turned to boat building, and the Alder Yard built over three hundred wooden fishing boats "
               "between 1912 and 1968. Today Port Alder has about four thousand inhabitants. Tourism is the "
               "largest employer, followed by the hospital and the ferry company, which runs four crossings a "
               "day to the islands. The town's museum, in the old customs house, shows the history of the "
               "herring trade and has a complete boat from the Alder Yard.",
    "policy": "Travel expenses policy. Employees may book economy class for flights shorter than six hours and "
              "premium economy for longer flights. Hotels must be booked through the company portal; the "
              "nightly limit is 150 euros in most cities and 220 euros in London, Paris, New York and Tokyo. "
              "Meals are reimbursed up to 60 euros per day with receipts. Taxis are allowed between 10 pm and 6 "
              "am, or when carrying equipment; otherwise use public transport. All expenses must be submitted "
              "within 30 days of the end of the trip, with receipts attached. Late claims need the approval of "
              "a director.",
    "battery": "The Model K battery pack stores 2.4 kilowatt hours and weighs 21 kilograms. It charges from 0 to 80 "
               "percent in 90 minutes with the standard charger, or in 45 minutes with the fast charger. The pack "
               "works between minus 10 and 45 degrees Celsius; below freezing, charging is slowed to protect the "
               "cells. The warranty covers 8 years or 3000 full cycles, whichever comes first, as long as the "
               "capacity stays above 70 percent. To store the pack for a long time, charge it to 50 percent and "
               "keep it in a dry place.",
}

DOCUMENT_PROMPTS = [
    f"{DOCUMENT['harbour']}\n\nAccording to the text above, what happened to the herring fishing and what did the "
    "town do after it? Quote the relevant sentences.",
    f"{DOCUMENT['harbour']}\n\nSummarise the text above in three sentences, reusing its wording.",
    f"{DOCUMENT['policy']}\n\nAccording to the policy above, what are the rules for hotels and meals? Quote them.",
    f"{DOCUMENT['policy']}\n\nWhen may an employee take a taxi, and how long do they have to submit expenses? "
    "Answer using the policy's words.",
    f"{DOCUMENT['battery']}\n\nWhat does the warranty of the Model K battery cover, and how should the pack be "
    "stored? Quote the document.",
]

CODE_SNIPPETS = [
    ("def average(numbers):\n"
     "    \"\"\"Return the arithmetic mean of a list of numbers.\"\"\"\n"
     "    total = 0\n"
     "    count = 0\n"
     "    for number in numbers:\n"
     "        total += number\n"
     "        count += 1\n"
     "    mean = total / count\n"
     "    print(f\"The average of {count} numbers is {mean}\")\n"
     "    return mean\n",
     "it returns 0 when the list is empty"),
    ("def read_config(path):\n"
     "    \"\"\"Read key=value lines from a file into a dictionary.\"\"\"\n"
     "    config = {}\n"
     "    with open(path) as f:\n"
     "        for line in f:\n"
     "            if line.startswith('#'):\n"
     "                continue\n"
     "            key, value = line.split('=')\n"
     "            config[key] = value\n"
     "    return config\n",
     "it strips whitespace from every key and value"),
    ("class Counter:\n"
     "    \"\"\"A simple counter.\"\"\"\n"
     "\n"
     "    def __init__(self):\n"
     "        self.count = 0\n"
     "\n"
     "    def increment(self):\n"
     "        self.count += 1\n"
     "        return self.count\n"
     "\n"
     "    def reset(self):\n"
     "        self.count = 0\n",
     "increment takes an optional step argument that defaults to 1"),
    ("def find_max(items):\n"
     "    \"\"\"Return the largest item of a non-empty list.\"\"\"\n"
     "    if not items:\n"
     "        raise ValueError('find_max() needs at least one item')\n"
     "    best = items[0]\n"
     "    for item in items[1:]:\n"
     "        if item > best:\n"
     "            best = item\n"
     "    return best\n",
     "it is called find_min and returns the smallest item"),
    ("def greet(name, greeting='Hello'):\n"
     "    \"\"\"Print and return a friendly greeting.\"\"\"\n"
     "    if not name:\n"
     "        name = 'friend'\n"
     "    message = greeting + ', ' + name + '!'\n"
     "    print(message)\n"
     "    return message\n",
     "it builds the message with an f-string"),
]

CODE_PROMPTS = [f"Here is some Python code:\n\n```python\n{code}```\n\nRewrite it so that {change}. Keep "
                "everything else as it is and return the complete code." for code, change in CODE_SNIPPETS]

CHAT_PROMPTS = [
    "What are some good habits for staying healthy?",
    "Write a short story about a cat who learns to fly.",
    "Why is the sky blue?",
    "Give me three ideas for a weekend trip.",
    "How do I start learning to play the guitar?",
]

# Earlier questions of the same user, in other sessions: what the answer index has seen before the chat
# workload runs (its answers are added to the index, never the questions).
EARLIER_CHAT_PROMPTS = [
    "What are the benefits of regular exercise?",
    "Write a short story about a dog who finds a treasure.",
    "Why do leaves change colour in autumn?",
    "Give me three ideas for a rainy afternoon.",
    "How do I start learning to paint?",
    "What are some tips for sleeping better?",
    "Write a short poem about the ocean.",
    "Why is the ocean salty?",
    "Suggest a few healthy breakfast ideas.",
    "How can I get better at public speaking?",
]

WORKLOADS = {"copy": COPY_PROMPTS, "document": DOCUMENT_PROMPTS, "code": CODE_PROMPTS, "chat": CHAT_PROMPTS}
