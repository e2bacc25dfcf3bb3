"""Chat-style calibration conversations for GPTQ at prepare time (written for this project).

Calibration data should look like what the served layers will see: chat-templated turns, questions
and answers on many topics, prose, lists, code and numbers. None of it is used for evaluation: the
perplexity text is tests/data/kjv_genesis_37-40.txt and the agreement prompts are those of
infemeral/eval/client_precision.py, on other subjects.
"""

CONVERSATIONS: tuple[tuple[str, str], ...] = (
    ("Can you explain what a hash table is and why lookups are fast?",
     "A hash table stores values in an array of buckets. To store a key, it runs the key through a hash "
     "function, which turns it into a number, and uses that number (modulo the array size) to pick a bucket. "
     "To look the key up later, it computes the same hash and goes straight to the same bucket, so it does not "
     "have to scan every entry. That is why a lookup takes constant time on average.\n\nTwo things can slow it "
     "down. First, collisions: two keys may land in the same bucket, so each bucket keeps a short list (or the "
     "table probes the next free slot). Second, load: as the table fills up, collisions become common, so most "
     "implementations grow the array, usually doubling it, once it is about three quarters full. Python's dict "
     "and Java's HashMap both work this way."),
    ("Write a Python function that returns the n-th Fibonacci number without recursion.",
     "Here is an iterative version that runs in linear time and constant memory:\n\n```python\ndef fibonacci(n: "
     "int) -> int:\n    \"\"\"Return the n-th Fibonacci number, with fibonacci(0) == 0.\"\"\"\n    if n < 0:\n"
     "        raise ValueError(\"n must be non-negative\")\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = "
     "b, a + b\n    return a\n```\n\nFor example, `fibonacci(10)` returns 55. Python integers do not overflow, so "
     "this works for large n as well, although the numbers get long quickly: fibonacci(1000) has 209 digits."),
    ("My landlord wants to raise the rent by 15 percent. How should I reply?",
     "It helps to stay polite and factual. You could write something like this:\n\nDear Ms. Alvarez,\n\nThank "
     "you for letting me know about the planned rent increase. I have enjoyed living here for the past three "
     "years and have always paid on time. A 15% increase is more than I can manage this year. Similar flats in "
     "the neighbourhood are listed for about 5% less than the new figure. Would you consider a smaller increase, "
     "for example 6%, or a longer lease at the current rate?\n\nKind regards,\nSam\n\nBefore sending it, check "
     "your lease and your local rules: some cities limit how much, and how often, rent may rise."),
    ("What is the difference between a virus and a bacterium?",
     "Bacteria are living single-celled organisms. They have their own metabolism, can grow and divide on their "
     "own, and many of them are harmless or even useful, like the ones in your gut. Some cause diseases such as "
     "strep throat or tuberculosis, and those can usually be treated with antibiotics.\n\nViruses are much "
     "smaller and are not cells at all. A virus is genetic material wrapped in a protein coat, and it can only "
     "reproduce by getting inside a host cell and hijacking its machinery. Antibiotics do nothing against them. "
     "Viral infections such as the flu or a cold are handled by the immune system, sometimes helped by antiviral "
     "drugs or prevented by vaccines."),
    ("Solve for x: 3x + 7 = 25, and show the steps.",
     "Start with the equation 3x + 7 = 25.\n\n1. Subtract 7 from both sides: 3x = 25 - 7 = 18.\n2. Divide both "
     "sides by 3: x = 18 / 3 = 6.\n\nCheck: 3 * 6 + 7 = 18 + 7 = 25, so x = 6 is correct."),
    ("Give me three ideas for a rainy Sunday with two kids aged 6 and 9.",
     "Here are three that work well at those ages:\n\n- **Build a blanket fort** with chairs, sheets and "
     "cushions, then read or watch a film inside it with a torch and some snacks.\n- **Kitchen science**: make a "
     "baking-soda volcano, grow salt crystals on a string, or test which objects float in a bowl of water. Let "
     "the nine-year-old write down predictions first.\n- **A treasure hunt** around the house, with rhyming clues "
     "that lead from room to room. The older child can help write clues for the younger one next time.\n\nIf "
     "the rain stops, a walk to splash in puddles is hard to beat."),
    ("How do I find all files larger than 100 MB in my home directory on Linux?",
     "Use `find` with a size filter:\n\n```sh\nfind ~ -type f -size +100M -exec ls -lh {} + 2>/dev/null | sort -k5 "
     "-h\n```\n\n`-type f` limits the search to regular files, `-size +100M` keeps those over 100 mebibytes, and "
     "`ls -lh` prints them with readable sizes; `sort -k5 -h` orders them by the size column. The `2>/dev/null` "
     "hides permission errors. If you only want the paths, drop the `-exec` part. For an overview by folder, "
     "`du -h --max-depth=1 ~ | sort -h` is often quicker."),
    ("Summarise the causes of the First World War in a short paragraph.",
     "The First World War grew out of several long-running tensions in Europe. The great powers had formed two "
     "rival blocs, the Triple Entente of France, Russia and Britain and the Triple Alliance around Germany and "
     "Austria-Hungary, so a local quarrel could draw everyone in. An arms race, especially between the British "
     "and German navies, and competition for colonies added mistrust. Nationalism unsettled the multi-ethnic "
     "Austro-Hungarian and Ottoman empires, above all in the Balkans. The spark came on 28 June 1914, when "
     "Archduke Franz Ferdinand was assassinated in Sarajevo; Austria-Hungary's ultimatum to Serbia set the "
     "alliances in motion, and within weeks most of Europe was at war."),
    ("Translate 'Where is the train station, please?' into French, Spanish and German.",
     "- French: « Où est la gare, s'il vous plaît ? »\n- Spanish: «¿Dónde está la estación de tren, por favor?»\n"
     "- German: „Wo ist der Bahnhof, bitte?“\n\nIn all three, adding a greeting first (Bonjour, Hola, Guten Tag) "
     "makes the question sound friendlier."),
    ("I keep waking up at 3 am and can't fall asleep again. Any advice?",
     "That is common and usually improves with a few habits. Keep the same wake-up time every day, even at "
     "weekends, so your body clock settles. Avoid caffeine after noon and alcohol in the evening, because "
     "alcohol often causes exactly this kind of early waking. If you are awake for more than about twenty "
     "minutes, get up, go to another room with dim light and do something calm, such as reading a paper book, "
     "until you feel sleepy. Try not to check the time or your phone. If it goes on for more than a few weeks, "
     "or you feel low or anxious during the day, talk to a doctor: insomnia is treatable, and cognitive "
     "behavioural therapy for insomnia works well for many people."),
    ("Write a SQL query that lists the five customers who spent the most in 2023.",
     "Assuming tables `customers(id, name)` and `orders(id, customer_id, total, created_at)`:\n\n```sql\nSELECT "
     "c.id, c.name, SUM(o.total) AS spent\nFROM customers AS c\nJOIN orders AS o ON o.customer_id = c.id\nWHERE "
     "o.created_at >= '2023-01-01' AND o.created_at < '2024-01-01'\nGROUP BY c.id, c.name\nORDER BY spent DESC\n"
     "LIMIT 5;\n```\n\nThe half-open date range includes every moment of 2023 and still lets the database use an "
     "index on `created_at`."),
    ("What should I look for when buying a used car?",
     "Start with the paperwork: the service history, the number of previous owners, and a check that the car "
     "is not stolen or still under finance. Then look at the car in daylight. Uneven gaps between panels or "
     "paint that does not quite match can mean accident repairs. Check the tyres for uneven wear, look under "
     "the car for rust and leaks, and make sure every light, window and the air conditioning work.\n\nOn the "
     "test drive, start the engine from cold, listen for knocking, and watch for smoke. The brakes should pull "
     "straight, and the gears should change smoothly. If you are not confident, pay a mechanic for an "
     "inspection; it costs far less than a bad purchase."),
    ("Tell me a short poem about autumn in a city.",
     "Leaves in the gutter, copper and brown,\nbuses hiss softly through the wet town.\nSteam from the bakery, "
     "lamps lit at four,\nscarves on the commuters who hurry past the door.\nThe park keeps its secrets in "
     "puddles and mist,\nand the year, growing older, is gentle to the last."),
    ("Explain compound interest with a simple example.",
     "Compound interest means you earn interest on your interest, not only on the money you first put in.\n\n"
     "Say you deposit 1,000 dollars at 5% a year. After one year you have 1,050. In the second year the 5% is "
     "applied to 1,050, so you earn 52.50 and end with 1,102.50. After ten years you would have about 1,629, "
     "whereas simple interest (5% of the original 1,000 each year) would give only 1,500. The formula is A = P "
     "(1 + r)^t, where P is the starting amount, r the yearly rate and t the number of years. The longer the "
     "money stays invested, the stronger the effect, which is why starting to save early matters so much."),
    ("Our customer says the invoice was charged twice. Draft a reply from support.",
     "Hello Mr. Okafor,\n\nThank you for contacting us, and I am sorry for the trouble. I have checked your "
     "account and can confirm that invoice #48213 was charged twice on 12 March because of a payment-processing "
     "error on our side. We have refunded the duplicate charge of 89.00 euros today. Depending on your bank, it "
     "should appear in your account within three to five working days.\n\nIf you do not see it by then, just "
     "reply to this email and I will follow it up personally.\n\nBest regards,\nLena from the support team"),
    ("Is it true that we only use ten percent of our brains?",
     "No, that is a myth. Brain scans show that we use virtually all of the brain, although not every region "
     "is equally active at the same moment: different areas handle movement, vision, language, memory and so "
     "on, and even during sleep many areas stay busy. The brain is also expensive to run. It is about 2% of "
     "body weight but uses roughly 20% of the body's energy, and evolution would hardly keep such a costly "
     "organ if 90% of it did nothing. Damage to almost any part of the brain has noticeable effects, which is "
     "further evidence that there is no large unused reserve."),
    ("Convert this to JSON: name Maria Lopez, age 34, languages English and Portuguese, active yes.",
     "```json\n{\n  \"name\": \"Maria Lopez\",\n  \"age\": 34,\n  \"languages\": [\"English\", \"Portuguese\"],\n"
     "  \"active\": true\n}\n```"),
    ("A bat and a ball cost 1.10 in total. The bat costs 1.00 more than the ball. How much is the ball?",
     "The ball costs 0.05.\n\nIt is tempting to say 0.10, but then the bat would cost 1.10 and the total would "
     "be 1.20. Call the ball's price b. The bat costs b + 1.00, so b + (b + 1.00) = 1.10, which gives 2b = 0.10 "
     "and b = 0.05. The bat costs 1.05, and together they cost 1.10."),
    ("How do I politely decline a meeting invitation at work?",
     "Keep it short, give a reason if you can, and offer an alternative. For example: \"Thanks for the invite. "
     "I won't be able to join on Thursday because I'm finishing the quarterly report that day. Could you share "
     "the notes afterwards, or would a quick chat on Friday morning work instead?\" If the meeting does not "
     "need you at all, it is fine to say so directly: \"I don't think I'd add much to this one, so I'll skip it, "
     "but let me know if anything comes up that needs my input.\""),
    ("What is the time complexity of binary search, and why?",
     "Binary search runs in O(log n) time. It works on a sorted array: it compares the target with the middle "
     "element and, depending on the result, throws away the half that cannot contain it. Each comparison halves "
     "the remaining range, so after k steps there are about n / 2^k elements left. The search ends when one "
     "element remains, that is when 2^k ≈ n, so k ≈ log2(n). For a million elements that is only about twenty "
     "comparisons. The catch is the precondition: the data must be sorted, and sorting costs O(n log n) once."),
    ("Plan a three-day trip to Rome for someone who loves history and food.",
     "Day 1, ancient Rome: the Colosseum, the Roman Forum and the Palatine Hill in the morning (book a combined "
     "ticket ahead). Lunch in Monti, then the Capitoline Museums. Dinner in Testaccio: try cacio e pepe and "
     "carciofi alla romana.\n\nDay 2, the Vatican: the Vatican Museums and the Sistine Chapel at opening time, "
     "then St Peter's Basilica and the dome. In the evening, walk to Piazza Navona and the Pantheon, and have "
     "supplì from a takeaway.\n\nDay 3, the old centre and Trastevere: Campo de' Fiori market in the morning, the "
     "Jewish Ghetto for fried artichokes, then cross the river to Trastevere for an afternoon stroll and a long "
     "dinner. Finish with gelato, and toss a coin into the Trevi Fountain on the way back."),
    ("Quick question: why is the sky blue?",
     "The sky looks blue because of the way sunlight is scattered by the air. Sunlight contains all "
     "colours. When it passes through the atmosphere, it bumps into nitrogen and oxygen molecules, which are "
     "much smaller than the wavelength of light. Such small particles scatter short wavelengths far more "
     "strongly than long ones (this is called Rayleigh scattering), so blue light is bounced around the whole "
     "sky and reaches your eyes from every direction. At sunset the light travels through much more air, most "
     "of the blue is scattered away before it reaches you, and the reds and oranges are left."),
    ("Write a regular expression that matches a valid 24-hour time like 09:45 or 23:59.",
     "This pattern matches hours 00 to 23 and minutes 00 to 59:\n\n```\n^([01][0-9]|2[0-3]):[0-5][0-9]$\n```\n\n"
     "`[01][0-9]` covers 00 to 19, `2[0-3]` covers 20 to 23, and `[0-5][0-9]` covers the minutes. The anchors "
     "`^` and `$` make sure nothing else is on the line. In Python: `re.fullmatch(r\"([01]\\d|2[0-3]):[0-5]\\d\", "
     "text)` does the same without the anchors."),
    ("I want to start running. How should a beginner begin?",
     "Start slower than you think you need to. A good plan for the first weeks is to alternate running and "
     "walking: for example one minute of easy running and two minutes of walking, repeated eight times, three "
     "days a week with a rest day in between. Each week, run a little longer and walk a little less. After about "
     "eight weeks most people can run thirty minutes without stopping.\n\nRun at a pace where you can still "
     "talk. Get shoes that feel comfortable in a running shop, warm up with a brisk walk, and do not increase "
     "your weekly distance by more than about ten percent. A little muscle soreness is normal; sharp pain is "
     "not, so stop and rest if you feel it."),
    ("Explain the difference between 'affect' and 'effect'.",
     "In most sentences, *affect* is a verb and *effect* is a noun. To affect something is to influence it: "
     "\"The weather affected our plans.\" An effect is the result: \"The weather had an effect on our plans.\" "
     "A handy memory aid is that Affect is an Action and Effect is an End result.\n\nThere are two less common "
     "uses: *effect* as a verb means to bring about (\"to effect change\"), and *affect* as a noun is a "
     "psychology term for displayed emotion (\"a flat affect\")."),
    ("What are the main differences between TCP and UDP?",
     "TCP is connection-oriented and reliable. Before sending data it sets up a connection with a handshake, "
     "numbers every byte, waits for acknowledgements, retransmits anything lost and delivers the data in order. "
     "It also slows down when the network is congested. That makes it the right choice for web pages, email "
     "and file transfers.\n\nUDP just sends independent datagrams. There is no connection, no retransmission and "
     "no ordering, so packets can be lost, duplicated or arrive out of order, but there is also less delay and "
     "overhead. Video calls, online games and DNS use UDP, because a late packet is worse than a lost one. "
     "Newer protocols such as QUIC build reliability on top of UDP themselves."),
    ("Can you recommend a vegetarian dinner that's ready in 20 minutes?",
     "Try a chickpea and spinach curry. Fry a chopped onion in oil for five minutes, add two cloves of garlic, "
     "a thumb of grated ginger and two tablespoons of curry paste, and stir for a minute. Pour in a tin of "
     "chopped tomatoes and a drained tin of chickpeas, simmer for ten minutes, then stir in two big handfuls of "
     "spinach until they wilt and finish with a splash of coconut milk or yoghurt and some lemon juice. Serve "
     "it with naan or microwave rice. It serves two, and it keeps well for lunch the next day."),
    ("How many seconds are there in a leap year?",
     "A leap year has 366 days. Each day has 24 hours, each hour 60 minutes and each minute 60 seconds, so "
     "366 × 24 × 60 × 60 = 366 × 86,400 = 31,622,400 seconds. A common year of 365 days has 31,536,000 seconds. "
     "(Occasional leap seconds, added to keep clocks in step with the Earth's rotation, are not counted here.)"),
)
