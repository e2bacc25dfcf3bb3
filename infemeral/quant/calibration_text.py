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
    ("Explain recursion with a small JavaScript example.",
     "A recursive function solves a problem by calling itself on a smaller version of the same problem, until "
     "it reaches a case simple enough to answer directly (the base case).\n\n```javascript\nfunction factorial(n) "
     "{\n  if (n <= 1) return 1;          // base case\n  return n * factorial(n - 1);   // smaller problem\n}\n\n"
     "console.log(factorial(5)); // 120\n```\n\nfactorial(5) asks for 5 * factorial(4), which asks for 4 * "
     "factorial(3), and so on down to factorial(1) = 1; then the multiplications are done on the way back up. "
     "Without the base case the calls would never stop and you would get a stack overflow."),
    ("I committed to the wrong branch in git. How do I undo the last commit but keep my changes?",
     "Run `git reset --soft HEAD~1`. It moves the branch back one commit and leaves your changes staged, exactly "
     "as they were before you committed. Then switch to the right branch and commit there:\n\n```sh\ngit reset "
     "--soft HEAD~1\ngit switch feature/login\ngit commit -m \"Add login form\"\n```\n\nIf you already pushed "
     "the commit, do not rewrite shared history; use `git revert <hash>` instead, which adds a new commit that "
     "undoes it."),
    ("What's the difference between RAM and storage?",
     "RAM is the computer's short-term working memory. Programs and the data they are using right now live "
     "there because it is extremely fast, but it is volatile: everything in it disappears when the power goes "
     "off. Storage (an SSD or hard drive) keeps your files, apps and the operating system permanently, even when "
     "the machine is off, but it is much slower than RAM.\n\nA desk is a good picture: RAM is the desk surface "
     "where you spread out what you are working on, storage is the filing cabinet. More RAM lets you keep more "
     "things open at once without slowing down; more storage lets you keep more things at all."),
    ("Write a haiku about morning coffee.",
     "Steam curls from the cup,\nthe kitchen still half asleep—\nfirst sip, the day starts."),
    ("What is inflation, in simple terms?",
     "Inflation is the general rise in prices over time, which means each unit of money buys a little less than "
     "before. If inflation is 3% a year, a basket of groceries that costs 100 today will cost about 103 a year "
     "from now.\n\nModerate, predictable inflation is normal in a growing economy, and most central banks aim for "
     "around 2%. Problems start when it is high or unpredictable: savings lose value, wages may lag behind "
     "prices, and businesses find it hard to plan. Central banks usually fight high inflation by raising "
     "interest rates, which makes borrowing more expensive and cools spending."),
    ("Explain photosynthesis to a high-school student.",
     "Photosynthesis is how plants, algae and some bacteria make their own food from light. In the chloroplasts "
     "of leaf cells, the green pigment chlorophyll absorbs light energy. The plant uses that energy to split "
     "water molecules taken up by the roots, releasing oxygen as a by-product. The energy is stored temporarily "
     "in carrier molecules called ATP and NADPH, which then power the Calvin cycle: a series of reactions that "
     "fix carbon dioxide from the air into sugar.\n\nThe overall equation is 6 CO2 + 6 H2O + light → C6H12O6 + 6 "
     "O2. Nearly all the oxygen we breathe and, directly or indirectly, almost all the food we eat comes from "
     "this process."),
    ("I have a job interview for a junior data analyst role on Friday. Any tips?",
     "Congratulations! A few things make a big difference:\n\n1. **Know the company.** Read their website and "
     "recent news, and think about what data they probably work with.\n2. **Prepare stories.** Have two or three "
     "short examples of projects where you cleaned messy data, found an insight or explained results to someone "
     "non-technical. Use the situation, task, action, result structure.\n3. **Practise the basics.** Expect SQL "
     "questions (joins, GROUP BY, window functions) and maybe a small spreadsheet or Python task.\n4. **Ask "
     "questions.** For example, what a typical week looks like, or how the team decides which analyses matter."
     "\n\nGet a good night's sleep, and arrive ten minutes early. Good luck!"),
    ("When should I use a list comprehension instead of a for loop in Python?",
     "Use a list comprehension when you are building a new list from an existing iterable with a simple "
     "transformation or filter:\n\n```python\nsquares = [x * x for x in range(10) if x % 2 == 0]\n```\n\nIt is "
     "shorter, and usually a little faster, than appending inside a loop. Use a regular for loop when the body "
     "has side effects (printing, writing files), needs several statements, or when the comprehension would "
     "need nested conditions that make it hard to read. A good rule: if it does not fit comfortably on one or "
     "two lines, write the loop."),
    ("Can you explain what an API is to someone who isn't technical?",
     "Think of a restaurant. You do not walk into the kitchen and cook; you read the menu and give your order to "
     "the waiter, who brings back your food. An API (application programming interface) is that menu and waiter "
     "for software. It lists what one program can ask another program to do, and in what format, without "
     "either of them needing to know how the other works inside.\n\nWhen a weather app on your phone shows the "
     "forecast, it is asking a weather service's API something like \"give me tomorrow's forecast for Lyon\" and "
     "getting back the answer in a standard format it can display."),
    ("How should I set up a simple monthly budget?",
     "Start with what actually comes in and goes out. Take your last two or three months of bank statements and "
     "sort every expense into a few categories: housing, utilities, groceries, transport, subscriptions, eating "
     "out and other. Then make a simple table with one row per category and columns for planned and actual "
     "amounts.\n\nA common starting point is the 50/30/20 rule: about half of your take-home pay for needs, 30% "
     "for wants and 20% for savings or paying off debt. Adjust it to your situation. Check the actual column "
     "once a week; the goal is not perfection but noticing where money goes, so you can decide on purpose."),
    ("What causes the seasons? Is it because the Earth is closer to the Sun in summer?",
     "No, distance has very little to do with it. In fact, the Earth is closest to the Sun in early January, "
     "which is winter in the northern hemisphere.\n\nThe seasons come from the tilt of the Earth's axis, about "
     "23.5 degrees. As the Earth orbits the Sun, the tilt stays pointed in the same direction in space, so for "
     "half the year the northern hemisphere leans towards the Sun and for the other half away from it. When your "
     "hemisphere leans towards the Sun, sunlight hits the ground more directly and days are longer, so it "
     "warms up: summer. When it leans away, the light is spread at a low angle over a larger area and days are "
     "short: winter."),
    ("Summarise the plot of Romeo and Juliet in a few sentences.",
     "In Verona, Romeo Montague and Juliet Capulet, children of two feuding families, fall in love at a party "
     "and marry in secret with the help of Friar Laurence. Soon after, Romeo kills Juliet's cousin Tybalt in a "
     "street fight and is banished. To avoid an arranged marriage, Juliet takes a potion that makes her appear "
     "dead, planning to escape with Romeo when she wakes. The message explaining the plan never reaches him; "
     "believing she is really dead, Romeo poisons himself at her tomb, and Juliet, waking to find him dead, "
     "stabs herself. Their deaths finally reconcile the two families."),
    ("How do I center a div horizontally and vertically with CSS?",
     "The simplest modern way is flexbox on the parent:\n\n```css\n.parent {\n  display: flex;\n  justify-content: "
     "center;   /* horizontal */\n  align-items: center;       /* vertical */\n  min-height: 100vh;         /* "
     "give it height to center within */\n}\n```\n\nGrid works too and is even shorter: `display: grid; "
     "place-items: center;`. Both center the child regardless of its size, so you do not need to know its width "
     "or height."),
    ("Write a short birthday message for a colleague I don't know very well.",
     "Happy birthday, Priya! Wishing you a relaxing day, good food and a great year ahead. Thanks for always "
     "being so helpful in our project meetings. Enjoy the celebrations!"),
    ("What's the difference between weather and climate?",
     "Weather is what the atmosphere is doing at a particular place and time: today's temperature, wind, "
     "cloud and humidity. It changes from hour to hour and day to day. Climate is the long-term pattern of "
     "weather in a region, usually described with averages and ranges over thirty years or more.\n\nA handy "
     "saying is that climate is what you expect, and weather is what you get. A single cold week does not tell "
     "you much about the climate, just as one hot summer does not; climate change shows up in the long-term "
     "trends of those averages and in how often extremes occur."),
    ("Why is quicksort O(n log n) on average but O(n^2) in the worst case?",
     "Quicksort picks a pivot, partitions the array into elements smaller and larger than the pivot, and sorts "
     "the two parts recursively. Partitioning a level costs O(n) in total.\n\nIf the pivot splits the array "
     "roughly in half, there are about log n levels of recursion, giving O(n log n). With random pivots this "
     "happens on average. The worst case is when the pivot is always the smallest or largest element, for "
     "example choosing the first element of an already sorted array. Then each partition removes only one "
     "element, there are n levels, and the total work is n + (n - 1) + ... + 1 = O(n^2). Random or "
     "median-of-three pivots make that case very unlikely."),
    ("My monstera's leaves are turning yellow. What am I doing wrong?",
     "Yellow leaves on a monstera most often mean too much water. Check the soil: if it is still damp a few "
     "centimetres down, wait before watering again, and make sure the pot has drainage holes so the roots do not "
     "sit in water. Water only when the top third of the soil is dry, usually every one to two weeks.\n\nOther "
     "causes are too little light (move it near a bright window, but out of harsh direct sun), a cold draught, "
     "or simply an old lower leaf dying off naturally, which is fine if it is just one now and then. If the "
     "roots are brown and mushy, repot it in fresh, airy soil and trim the rotten roots."),
    ("What's the capital of Australia? And tell me something interesting about it.",
     "The capital of Australia is Canberra, not Sydney or Melbourne, as many people assume. It was chosen as a "
     "compromise between those two rival cities and built as a planned capital in the early twentieth century. "
     "The American architects Walter Burley Griffin and Marion Mahony Griffin won the international design "
     "competition, and the city's centre is laid out around a large artificial lake named after Walter. "
     "Parliament moved there in 1927."),
    ("Explain the Pythagorean theorem with an example.",
     "In a right-angled triangle, the square of the longest side (the hypotenuse, opposite the right angle) "
     "equals the sum of the squares of the other two sides: a² + b² = c².\n\nExample: a ladder leans against a "
     "wall. Its foot is 3 metres from the wall and it reaches 4 metres up. The ladder is the hypotenuse, so c² = "
     "3² + 4² = 9 + 16 = 25, and c = 5 metres. The theorem also works backwards: if the sides satisfy a² + b² = "
     "c², the triangle has a right angle, which builders use to check corners with a 3-4-5 measurement."),
    ("Write a Dockerfile for a small Flask app.",
     "Assuming `app.py` defines `app` and your dependencies are in `requirements.txt`:\n\n```dockerfile\nFROM "
     "python:3.12-slim\n\nWORKDIR /app\nCOPY requirements.txt .\nRUN pip install --no-cache-dir -r "
     "requirements.txt gunicorn\nCOPY . .\n\nRUN useradd --create-home appuser\nUSER appuser\n\nEXPOSE 8000\nCMD "
     "[\"gunicorn\", \"--bind\", \"0.0.0.0:8000\", \"app:app\"]\n```\n\nCopying `requirements.txt` first lets "
     "Docker cache the installed packages when only your code changes, gunicorn is a proper production server "
     "instead of Flask's development server, and the app does not run as root. Build and run it with `docker "
     "build -t myapp .` and `docker run -p 8000:8000 myapp`."),
    ("A coworker keeps interrupting me in meetings. How do I handle it without making things awkward?",
     "Start small and in the moment. When it happens, keep your tone friendly and say something like \"I'd like "
     "to finish this thought, then I'd love to hear yours.\" Most people back off once it is named calmly.\n\nIf "
     "it continues, talk to them privately rather than in front of others: \"I've noticed I often get cut off in "
     "meetings, and it makes it hard to get my point across. Could you help me with that?\" Assume good intent; "
     "many interrupters do not realise they do it. If nothing changes, it is reasonable to ask whoever runs the "
     "meetings to keep a speaking order."),
    ("Convert 72 degrees Fahrenheit to Celsius.",
     "Use C = (F − 32) × 5/9.\n\n(72 − 32) × 5/9 = 40 × 5/9 ≈ 22.2 °C. So 72 °F is a comfortable room "
     "temperature of about 22 degrees Celsius."),
    ("What does overfitting mean in machine learning?",
     "Overfitting is when a model learns the training data too well, including its noise and quirks, so it "
     "performs great on the examples it has seen but badly on new ones. It is like a student who memorises the "
     "answers to last year's exam instead of understanding the subject.\n\nYou spot it when training accuracy "
     "keeps improving while accuracy on a held-out validation set stalls or gets worse. Common remedies are more "
     "training data, a simpler model, regularisation (such as weight decay or dropout), data augmentation, and "
     "early stopping: stop training when the validation score stops improving."),
    ("Write a limerick about a cat who hates Mondays.",
     "A tabby named Tom from Dundee\nwould sulk every Monday till three.\nHe'd glare at the clock,\nknock the pens "
     "off the block,\nthen nap on the keyboard with glee."),
    ("What's a good beginner strength routine I can do at home with no equipment?",
     "Try this three times a week, with a rest day in between:\n\n- Squats: 3 sets of 12\n- Push-ups (on your "
     "knees or against a table if needed): 3 sets of 8–10\n- Glute bridges: 3 sets of 15\n- Reverse lunges: 3 "
     "sets of 10 per leg\n- Plank: 3 holds of 20–30 seconds\n\nRest about a minute between sets. Move slowly and "
     "with control; good form matters more than numbers. When the last set of an exercise feels easy, add two "
     "or three repetitions, or switch to a harder version, such as full push-ups or split squats."),
    ("How do I rename all .jpeg files in a folder to .jpg with bash?",
     "A loop with parameter expansion does it:\n\n```sh\nfor f in *.jpeg; do\n  [ -e \"$f\" ] || continue\n  mv -- "
     "\"$f\" \"${f%.jpeg}.jpg\"\ndone\n```\n\n`${f%.jpeg}` removes the `.jpeg` suffix, the `[ -e \"$f\" ]` test "
     "skips the loop when there are no matching files, and `--` protects file names that start with a dash. "
     "Quoting the variables keeps names with spaces intact. Run it with `echo mv` instead of `mv` first if you "
     "want to see what it would do."),
    ("How does a credit score work?",
     "A credit score is a number lenders use to estimate how likely you are to repay a loan. In the US, FICO "
     "scores range from 300 to 850. They are calculated from your credit report, and the main ingredients are "
     "roughly: payment history (about 35%), how much of your available credit you use (30%), the length of your "
     "credit history (15%), new credit applications (10%) and the mix of credit types (10%).\n\nTo improve it: "
     "pay every bill on time, keep your card balances well below their limits (under 30%, ideally lower), avoid "
     "opening many new accounts at once, and keep old accounts open. Check your report once a year for errors."),
    ("Here are my meeting notes: 'budget approved, launch moved to May 12, Ana to hire 2 devs, need new logo "
     "by April'. Turn them into a clean summary.",
     "**Meeting summary**\n\n- **Budget:** approved.\n- **Launch date:** moved to 12 May.\n- **Hiring:** Ana will "
     "recruit two developers.\n- **Branding:** a new logo is needed by April.\n\n**Action items**\n\n| Owner | Task "
     "| Due |\n|---|---|---|\n| Ana | Hire two developers | before launch |\n| Design (owner to be confirmed) | "
     "New logo | April |"),
    ("When do I use 'its' and when 'it's'?",
     "*It's* is always a contraction of \"it is\" or \"it has\": \"It's raining\", \"It's been a long day\". *Its* "
     "is the possessive, like *his* or *her*, and has no apostrophe: \"The dog wagged its tail.\" A quick test: "
     "try replacing the word with \"it is\". If the sentence still makes sense, write *it's*; if not, write "
     "*its*."),
    ("Explain Rust's ownership rules briefly.",
     "Rust manages memory without a garbage collector through three rules: each value has exactly one owner; "
     "when the owner goes out of scope, the value is dropped; and ownership can be moved, after which the old "
     "variable can no longer be used.\n\nInstead of moving, you can borrow a value with references. You may have "
     "any number of immutable references (`&T`) or exactly one mutable reference (`&mut T`) at a time, never "
     "both. The compiler's borrow checker enforces this at compile time, which rules out use-after-free bugs and "
     "data races before the program ever runs."),
)
