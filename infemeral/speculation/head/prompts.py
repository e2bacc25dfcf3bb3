"""The chat prompts a draft head is trained on: open questions of many kinds, written for this purpose.

The model answers them itself (self-distillation), so they only have to look like what people ask a
chat model: explanations, how-tos, advice, comparisons, stories and poems, facts, small programs,
e-mails. Templates are crossed with subjects and interleaved by kind, so any prefix of the list is
balanced. The first 766 are those plain prompts (heads and cached answers are keyed by them, so they never
change); after them each plain prompt comes again with an answer style asked for ("as a numbered list", "for
a beginner", ...), every kind in proportion, for runs that afford ten times the CPU's answers.
`held_out_prompts()` are written from subjects no training prompt uses: the fixed set on which heads trained
on any number of these are compared. None of them is a prompt of the speculation benchmark
(`scripts/bench/workloads.py`), which measures heads trained on these.
"""

from __future__ import annotations

import functools
import random

EXPLAIN = (
    "Explain {} in simple terms.",
    "How does {} work?",
    "What is {}, and why does it matter?",
    "Can you describe {} to a ten-year-old?",
)
CONCEPTS = (
    "photosynthesis", "inflation", "a black hole", "the water cycle", "a vaccine", "compound interest",
    "machine learning", "the stock market", "an electric motor", "the immune system", "gravity", "a blockchain",
    "plate tectonics", "the greenhouse effect", "a credit score", "DNA", "a search engine", "supply and demand",
    "the internet", "an earthquake", "a rainbow", "nuclear fusion", "a solar panel", "the human heart",
    "a refrigerator", "evolution by natural selection", "a democracy", "a hurricane", "the moon's phases",
    "antibiotics", "a jet engine", "encryption", "the placebo effect", "a tax return", "recycling",
    "the theory of relativity", "a volcano", "a computer's memory", "sleep cycles", "a mortgage",
    "wind power", "the nervous system", "a tide", "an allergy", "GPS navigation", "a microwave oven",
    "interest rates", "a coral reef", "the Roman Empire's fall", "a neural network",
)

HOW_TO = (
    "How do I {}?",
    "What are the steps to {}?",
    "I want to {}. Where should I begin?",
)
TASKS = (
    "make a monthly budget", "write a cover letter", "care for a houseplant", "bake sourdough bread",
    "change a flat tyre", "prepare for a job interview", "learn a new language quickly", "start running",
    "organise my closet", "plant a vegetable garden", "write a good essay", "save money on groceries",
    "improve my handwriting", "train a puppy", "set up a home network", "make friends in a new city",
    "start a small business", "write a resume", "cook rice perfectly", "learn to swim as an adult",
    "reduce my screen time", "choose a good laptop", "start meditating", "keep a journal",
    "clean a cast iron pan", "negotiate a higher salary", "build a birdhouse", "learn to touch type",
    "prepare for a marathon", "repaint a room", "back up my photos", "brew good coffee at home",
    "write a short speech for a wedding", "study for an exam", "take better photos with my phone",
    "fix a leaking tap", "start a podcast", "make homemade pasta", "stop procrastinating", "learn chess",
)

TIPS = (
    "Give me five tips for {}.",
    "What are common mistakes people make when {}?",
    "List a few ways to get better at {}.",
)
ACTIVITIES = (
    "working from home", "cooking for a family", "travelling on a budget", "studying mathematics",
    "managing stress", "writing fiction", "drawing portraits", "playing tennis", "gardening in a small space",
    "learning to code", "raising teenagers", "hiking in the mountains", "giving feedback at work",
    "keeping a tidy kitchen", "running a meeting", "reading more books", "camping with children",
    "learning the piano", "taking notes in class", "riding a bicycle in a city", "baking cakes",
    "staying focused", "writing emails", "moving to a new home", "caring for an elderly parent",
    "buying a used car", "hosting a dinner party", "making a presentation", "birdwatching", "knitting",
)

CREATIVE = (
    "Write a short story about {}.",
    "Write a four-line poem about {}.",
    "Describe {} in one vivid paragraph.",
)
SUBJECTS = (
    "a robot who wants to become a gardener", "an old lighthouse in a storm", "a child's first day at school",
    "a dragon who is afraid of the dark", "a city at dawn", "a lost umbrella", "the last tree in a desert",
    "a friendship between a fox and an owl", "a train journey through the snow", "a grandmother's kitchen",
    "a pirate who cannot swim", "the first snowfall of the year", "a busy market", "an astronaut missing home",
    "a clock that runs backwards", "a quiet library", "a mountain village", "a musician on a street corner",
    "a summer thunderstorm", "a bakery at midnight", "a boy who collects stones", "a forgotten birthday",
    "the smell of rain", "a shipwreck", "an inventor's workshop", "a field of sunflowers", "a haunted bicycle",
    "a penguin on holiday", "a letter that arrives fifty years late", "the view from a hot air balloon",
)

COMPARE = (
    "What is the difference between {} and {}?",
    "Compare {} and {}. Which would you recommend, and when?",
)
PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("stocks", "bonds"), ("tea", "coffee"),
    ("Python", "JavaScript"), ("renting", "buying a home"), ("a crocodile", "an alligator"),
    ("speed", "velocity"), ("baking soda", "baking powder"), ("an LED", "an incandescent bulb"),
    ("a lake", "a pond"), ("empathy", "sympathy"), ("a laptop", "a desktop computer"), ("butter", "margarine"),
    ("a hurricane", "a tornado"), ("fiction", "non-fiction"), ("RAM", "storage"), ("a comet", "an asteroid"),
    ("yoga", "pilates"), ("a debit card", "a credit card"), ("a violin", "a viola"), ("AC", "DC current"),
    ("an ocean", "a sea"), ("a psychologist", "a psychiatrist"), ("wool", "cotton"),
)

FACTS = (
    "Tell me some interesting facts about {}.",
    "What should a visitor know about {}?",
)
THINGS = (
    "octopuses", "the city of Kyoto", "honey bees", "the Amazon rainforest", "the planet Mars", "elephants",
    "the Sahara desert", "Iceland", "the Great Wall of China", "owls", "the Pacific Ocean", "Venice",
    "sharks", "the Moon", "Antarctica", "the Alps", "dolphins", "the city of Lisbon", "tigers", "Saturn",
    "the Nile", "hummingbirds", "New Zealand", "the Grand Canyon", "whales", "Mount Everest", "Scotland",
    "ants", "the Arctic", "the city of Istanbul",
)

PROS_CONS = (
    "What are the pros and cons of {}?",
    "Should I consider {}? Help me think it through.",
)
CHOICES = (
    "working four days a week", "an electric car", "homeschooling", "living in a big city", "a gap year",
    "adopting a cat", "learning online", "a standing desk", "solar panels on my roof", "a vegetarian diet",
    "freelancing", "a smartwatch", "studying abroad", "a small wedding", "cycling to work",
    "buying a house with friends", "a tiny house", "getting a dog", "renting furniture", "a career change at forty",
)

CODE = (
    "Write a Python function that {}.",
    "How would I write a JavaScript function that {}?",
)
CODE_TASKS = (
    "checks whether a word is a palindrome", "counts the vowels in a string", "reverses a linked list",
    "finds the second largest number in a list", "converts Celsius to Fahrenheit", "removes duplicates from a list",
    "checks whether a number is prime", "merges two sorted lists", "computes the factorial of a number",
    "returns the most common word in a text", "validates an email address", "flattens a nested list",
    "sorts a list of dictionaries by a key", "computes the Fibonacci numbers up to n", "reads a CSV file",
    "capitalises the first letter of every word", "finds the longest word in a sentence",
    "counts the lines in a file", "checks whether two strings are anagrams", "sums the digits of a number",
)

WRITE = (
    "Help me write an email to {} {}.",
)
RECIPIENTS = ("my landlord", "my manager", "a colleague", "my child's teacher", "a customer", "my neighbour",
              "a hotel", "a professor", "my team", "a friend I have not seen for years")
PURPOSES = ("asking for a meeting next week", "explaining that I will be late", "thanking them for their help",
            "asking for a refund", "proposing a new idea", "apologising for a mistake")

PLAN = (
    "Plan a three-day visit to {}.",
    "Suggest a menu for {}.",
)
PLACES = ("Rome", "Tokyo", "Barcelona", "Edinburgh", "Vienna", "Prague", "Copenhagen", "Lisbon", "Amsterdam",
          "Buenos Aires")
OCCASIONS = ("a picnic in the park", "a birthday party for a six-year-old", "a cosy winter dinner",
             "a vegetarian barbecue", "a romantic anniversary dinner", "a lunch for busy colleagues")


def _kind(templates, items) -> list[str]:
    out = []
    for template in templates:
        for item in items:
            out.append(template.format(*item) if isinstance(item, tuple) else template.format(item))
    return out


STYLES = (
    "Answer in a few sentences.", "Answer as a numbered list.", "Explain it for a beginner.",
    "Keep it under a hundred words.", "Go into detail.", "Use a friendly, informal tone.", "Include an example.",
    "Start with a one-line summary.", "Use plain words and short sentences.", "Answer as a patient teacher would.",
)

# Subjects of no training prompt, two per kind: the comparison set's (`held_out_prompts`)
HELD_OUT_ITEMS = (
    (EXPLAIN, ("a thermostat", "ocean currents")),
    (HOW_TO, ("descale a kettle", "plan a road trip")),
    (TIPS, ("public speaking", "growing tomatoes")),
    (CREATIVE, ("a snowman who dreams of summer", "a kite caught in a tree")),
    (COMPARE, (("a frog", "a toad"), ("walking", "swimming"))),
    (FACTS, ("koalas", "the river Danube")),
    (PROS_CONS, ("buying a motorbike", "learning two languages at once")),
    (CODE, ("counts the words in a sentence", "checks whether a year is a leap year")),
    (WRITE, (("my dentist", "asking to move my appointment"), ("the city council", "reporting a broken streetlight"))),
    (PLAN[:1], ("Krakow", "Seville")),
)


@functools.lru_cache(maxsize=4)
def _all_prompts(seed: int) -> tuple[str, ...]:
    """Every training prompt in order: the plain ones interleaved by kind (unchanged since heads were first
    trained on them), then each again with each answer style, the kinds merged in proportion to their sizes."""
    kinds = [_kind(EXPLAIN, CONCEPTS), _kind(HOW_TO, TASKS), _kind(TIPS, ACTIVITIES), _kind(CREATIVE, SUBJECTS),
             _kind(COMPARE, PAIRS), _kind(FACTS, THINGS), _kind(PROS_CONS, CHOICES), _kind(CODE, CODE_TASKS),
             _kind(WRITE, [(r, p) for r in RECIPIENTS for p in PURPOSES]),
             _kind(PLAN[:1], PLACES) + _kind(PLAN[1:], OCCASIONS)]
    rng = random.Random(seed)
    for prompts in kinds:
        rng.shuffle(prompts)
    out: list[str] = []
    for i in range(max(len(k) for k in kinds)):
        out += [k[i] for k in kinds if i < len(k)]
    # round r gives a kind's i-th prompt style i + r: every round each prompt once and the styles evenly
    styled = [[f"{p} {STYLES[(i + r) % len(STYLES)]}" for r in range(len(STYLES)) for i, p in enumerate(k)]
              for k in kinds]
    # the j-th of a kind goes where (j + 1/2) / its size falls: every prefix holds each kind in proportion
    order = sorted(((j + 0.5) / len(k), n, j) for n, k in enumerate(styled) for j in range(len(k)))
    return tuple(out) + tuple(styled[n][j] for _, n, j in order)


def chat_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """The first `count` training prompts (all of them if None), kinds interleaved, in a fixed order: a prefix
    of any longer list. Asking for more than there are is a ValueError that says how many there are."""
    prompts = _all_prompts(seed)
    if count is not None and count > len(prompts):
        raise ValueError(f"{count} chat prompts asked for, but there are {len(prompts)}")
    return list(prompts if count is None else prompts[:count])


def held_out_prompts() -> list[str]:
    """The comparison set: two prompts of each kind on subjects no training prompt has (so no head trained on
    any prefix of `chat_prompts` has seen them), one plain and one with an answer style, as training has both."""
    out = []
    for n, (templates, (plain, styled)) in enumerate(HELD_OUT_ITEMS):
        out.append(_kind(templates[:1], [plain])[0])
        out.append(f"{_kind(templates[-1:], [styled])[0]} {STYLES[n % len(STYLES)]}")
    return out
