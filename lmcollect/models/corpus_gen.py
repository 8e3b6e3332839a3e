"""Generate ``corpus.txt``, the small English + arithmetic text the tokenizer is trained on.

The committed ``corpus.txt`` is the output of ``python -m lmcollect.models.corpus_gen``; the
generator is deterministic (a fixed-seed ``random.Random``), so the file can be rebuilt exactly.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
CORPUS_SEED = 1234

PROSE = """\
The morning was cold and bright, and the river ran fast under the old stone bridge.
A small boat drifted past the mill while two children counted the ducks on the bank.
She opened the window, listened to the rain, and decided that the letter could wait until tomorrow.
Most people learn to read long before they learn to write clearly, and some never learn to listen.
The library closes at six o'clock on weekdays and at noon on Saturday.
He planted tomatoes, beans, and carrots in the garden behind the house.
When the train finally arrived, the station was almost empty except for a tired porter.
Good questions are often more useful than quick answers.
The committee met on Tuesday to discuss the budget, the new roof, and the summer festival.
Water boils at one hundred degrees Celsius at sea level, but at a lower temperature on a mountain.
A careful cook tastes the soup before adding more salt.
The museum has a collection of maps, coins, clocks, and paintings from many different centuries.
Every winter the lake freezes, and the village holds a skating race on the first clear Sunday.
Please remember to turn off the lights and lock the door when you leave.
The scientist wrote down each measurement in a notebook, even the ones that looked wrong.
Our neighbour keeps bees, and in August she gives everyone a jar of honey.
The road to the coast winds through forests, farms, and quiet little towns.
If you are not sure, it is better to ask than to guess.
The teacher explained the problem twice, then asked the students to try it on their own.
Music drifted from an open window as the evening grew warm and still.
Computers follow instructions exactly, which is both their strength and their weakness.
The cat slept on the sunny windowsill while the dog waited patiently by the door.
A good map shows not only roads and rivers but also hills, forests, and small paths.
They walked along the beach, collecting shells and watching the waves roll in.
History is full of surprising stories about ordinary people in difficult times.
The bakery on the corner sells fresh bread every morning before seven.
Clouds gathered over the hills, and soon the first heavy drops of rain began to fall.
It takes patience to learn a new language, but every small step makes the next one easier.
The engineer checked the bridge for cracks and reported that it was safe.
On clear nights you can see thousands of stars, and sometimes a bright planet near the moon.
A friendly assistant answers politely, explains its reasoning, and admits when it is wrong.
The market was crowded with people buying apples, cheese, flowers, and warm bread.
Reading aloud helps young children learn new words and enjoy stories together.
The old clock in the hall struck twelve, and the house fell silent again.
Sometimes the simplest solution is the correct one, but not always.
The farmer woke before dawn to feed the animals and check the fences.
A healthy breakfast gives you energy for the whole morning.
The students built a small robot that could follow a line drawn on the floor.
Autumn leaves turned red, orange, and gold before falling to the ground.
Keep your answers short, clear, and honest.
The orchestra rehearsed the symphony until every musician knew exactly when to enter.
Volcanoes form where molten rock rises through cracks in the earth's crust.
A journalist should verify each quotation and cite reliable sources.
The pharmacy around the corner is open late on Thursdays and Fridays.
Penguins cannot fly, but they are excellent swimmers and divers.
My grandmother knitted scarves, mittens, and sweaters for the entire family.
The astronaut described the silence of space and the beauty of the blue planet below.
Vocabulary grows quickly when you read widely and look up unfamiliar words.
The carpenter measured twice and cut once, just as his apprentice had been taught.
Thunder rumbled in the distance while lightning flickered above the valley.
Electricity travels through copper wires because copper conducts it very well.
The hospital hired additional nurses during the busy flu season.
We celebrated her birthday with chocolate cake, lemonade, and a treasure hunt.
The detective examined the footprints, the torn envelope, and the half empty glass.
Photosynthesis lets plants turn sunlight, water, and carbon dioxide into sugar and oxygen.
The city council approved a plan for wider sidewalks and safer bicycle lanes.
Architects design buildings that must be beautiful, practical, and strong.
A thermometer measures temperature, and a barometer measures air pressure.
The chess champion considered every possible move before touching a piece.
Fishermen mended their nets while seagulls circled above the harbour.
Gravity keeps the planets in orbit around the sun.
The volunteers cleaned the playground, painted the benches, and planted new trees.
Medicine has improved enormously over the last two hundred years.
The waiter recommended the mushroom risotto and a bowl of tomato soup.
Elephants remember familiar places and recognize old companions.
The printer jammed again, so the secretary fixed it with a paper clip.
Mathematics describes patterns, shapes, quantities, and change.
An encyclopedia contains articles about almost every subject imaginable.
The kangaroo carries its baby in a pouch until the joey is ready to hop.
During the holidays the shops are decorated with ribbons, lights, and evergreen branches.
Good software is tested thoroughly, documented honestly, and maintained carefully.
The hikers followed the trail through the canyon and camped beside a waterfall.
A dictionary lists words alphabetically along with their meanings and pronunciations.
Wolves hunt together in packs and communicate by howling.
The orchard produced so many pears that the family shared them with the neighbours.
The pilot announced a short delay because of strong winds over the airport.
Chemistry explains why iron rusts, why bread rises, and why fireworks sparkle.
The professor encouraged curiosity, criticism, and careful experiments.
Whales migrate thousands of kilometres between feeding grounds and breeding grounds.
The bakery's cinnamon rolls were famous throughout the neighbourhood.
Voters queued patiently outside the school gymnasium on election day.
The mechanic replaced the brakes, rotated the tyres, and changed the oil.
A compass needle points north because of the earth's magnetic field.
The choir practised harmonies in the chapel every Wednesday evening.
Snowflakes are formed from tiny crystals of ice, and no two look exactly alike.
The lighthouse keeper polished the lamp and recorded the weather in a logbook.
Translators must understand culture and idiom, not just grammar.
The squirrel buried acorns throughout the autumn and forgot where half of them were.
Democracy depends on informed citizens, fair elections, and a free press.
The jeweller repaired the bracelet and cleaned the antique pocket watch.
Owls hunt silently at night, guided by excellent hearing.
Spreadsheets organize information into rows and columns.
The festival featured jugglers, acrobats, puppeteers, and a brass band.
Earthquakes are measured with instruments called seismographs.
The gardener pruned the roses, trimmed the hedge, and watered the vegetables.
"""


def _words(text: str) -> tuple[str, ...]:
    """The whitespace-separated words of ``text``, in order."""
    return tuple(text.split())


NAMES = _words("""
    Alice Bob Carol David Emma Frank Grace Henry Irene James Karen Liam Maria Noah Olivia Peter Quinn
    Rosa Sam Tara Victor Wendy Yusuf Zoe
""")
NOUNS = _words("""
    apple book river mountain window garden teacher student kitchen letter bottle candle forest island
    castle village market engine bicycle blanket button camera ladder mirror pencil pocket rabbit saddle
    ticket tunnel violin wallet harbor meadow planet puzzle basket bridge cookie dragon feather hammer
    jacket lantern needle orange parrot quilt rocket sandwich turtle umbrella wagon yard zebra question
    answer number problem result game player riddle secret lesson story song picture machine journey
    weather season office doctor nurse farmer painter sailor pilot baker writer anchor balloon cabinet
    diamond envelope fountain glacier helmet igloo jungle kettle lobster magnet notebook octopus pyramid
    raincoat scissors telescope uniform volcano whistle xylophone yogurt accordion biscuit compass
    dolphin elevator flamingo giraffe hedgehog iceberg jellyfish keyboard lighthouse microscope
    nightingale ostrich pineapple quarry reindeer skyscraper tractor unicorn vineyard waterfall chimney
    cottage cupboard curtain drawer fireplace hallway staircase ceiling pillow saucepan spoon teapot
    toaster vase calendar chapter diary headline magazine newspaper paragraph poem sentence alphabet
    equation fraction triangle circle square rectangle cylinder sphere diagram formula hypothesis
    experiment laboratory astronomer architect carpenter electrician firefighter gardener librarian
    mechanic musician photographer plumber scientist surgeon
""")
ADJECTIVES = _words("""
    quick slow bright dark quiet loud small large gentle brave clever careful curious happy tired hungry
    ancient modern heavy light warm cold simple strange friendly narrow wide green yellow purple silver
    golden wooden broken hidden famous patient honest polite useful difficult easy early late empty full
    anxious blissful cheerful delicate eager fierce graceful humble invisible jealous keen lively
    mysterious nervous obedient peculiar reliable sincere thoughtful unusual vivid wealthy youthful
    zealous enormous tiny crooked shiny dusty muddy fragile sturdy rusty fluffy slippery spicy bitter
    sweet sour salty crispy juicy
""")
VERBS_PAST = _words("""
    found carried painted opened closed watched followed visited repaired borrowed returned described
    counted measured noticed remembered forgot discovered explained answered guessed checked cleaned
    cooked drew wrote read sold bought built admired balanced collected delivered examined fetched
    gathered hid inspected juggled kicked lifted mended named ordered polished questioned rescued
    sketched tossed unpacked wrapped photographed decorated weighed shared chased dropped hugged
""")
PLACES = (
    "in the park",
    "near the station",
    "behind the school",
    "at the harbor",
    "on the hill",
    "under the bridge",
    "by the lake",
    "inside the museum",
    "across the street",
    "at home",
    "in the library",
    "on the farm",
    "in the city",
    "at the market",
    "in the kitchen",
)
TIMES = (
    "yesterday",
    "this morning",
    "last week",
    "on Monday",
    "after lunch",
    "before dinner",
    "in the evening",
    "at midnight",
    "during the storm",
    "in the spring",
    "every day",
    "on Friday",
    "last summer",
    "next winter",
    "at sunrise",
    "at sunset",
    "on Saturday",
)
TOPICS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "There are 7 days in a week."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("What do bees make?", "Bees make honey."),
    ("Which is larger, the sun or the moon?", "The sun is much larger than the moon."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is the opposite of higher?", "The opposite of higher is lower."),
    ("How many months are in a year?", "There are 12 months in a year."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Can you help me?", "Of course. Tell me what you need."),
    ("Thank you!", "You are welcome."),
    ("Hello, who are you?", "I am a small assistant. I answer questions and play games."),
    ("What is the first letter of the alphabet?", "The first letter is A."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Answer with a single number.",
    "You are playing a guessing game. Reply with one number.",
    "Answer the question briefly and correctly.",
)


def _prose_lines() -> list[str]:
    return [line for line in PROSE.splitlines() if line.strip()]


def _story_line(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    adj, noun = rng.choice(ADJECTIVES), rng.choice(NOUNS)
    verb, place, time = rng.choice(VERBS_PAST), rng.choice(PLACES), rng.choice(TIMES)
    forms = (
        f"{name} {verb} a {adj} {noun} {place} {time}.",
        f"{time[0].upper()}{time[1:]}, {name} and {other} {verb} the {noun} {place}.",
        f"The {adj} {noun} that {name} {verb} was {rng.choice(ADJECTIVES)}.",
        f"{name} asked {other} where the {noun} was, and {other} said it was {place}.",
        f"There were {rng.randint(2, 99)} {noun}s {place}, and {name} {verb} {rng.randint(1, 9)} of them.",
    )
    return rng.choice(forms)


def _arithmetic_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    if op == "+":
        return f"{a} + {b} = {a + b}"
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} = {a - b}"
    a, b = a % 13, b % 13
    return f"{a} * {b} = {a * b}"


def _word_problem_line(rng: random.Random) -> str:
    name, noun = rng.choice(NAMES), rng.choice(NOUNS)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return (
        f"{name} has {a} {noun}s and gets {b} more. How many {noun}s does {name} have now? "
        f"{a} + {b} = {a + b}. The answer is {a + b}."
    )


def _chat(messages: list[tuple[str, str]]) -> str:
    """A dialog as ``role`` / ``content`` lines (no special tokens: the BPE trainer would merge them)."""
    return "\n".join(f"{role}\n{content}" for role, content in messages)


def _qa_chat(rng: random.Random) -> str:
    if rng.random() < 0.5:
        question, answer = rng.choice(TOPICS)
    else:
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        question, answer = f"What is {a} + {b}?", f"{a} + {b} = {a + b}. The answer is {a + b}."
    return _chat([("system", rng.choice(SYSTEM_PROMPTS)), ("user", question), ("assistant", answer)])


def _guess_chat(rng: random.Random) -> str:
    low, high = 1, rng.choice((10, 20, 50, 100))
    target = rng.randint(low, high)
    messages = [("user", f"I am thinking of a number between {low} and {high}. Guess it.")]
    for _ in range(7):
        guess = (low + high) // 2
        messages.append(("assistant", f"My guess is {guess}."))
        if guess == target:
            messages.append(("user", f"Correct! The number was {target}."))
            break
        if guess < target:
            low = guess + 1
            messages.append(("user", f"{guess} is too low. Go higher."))
        else:
            high = guess - 1
            messages.append(("user", f"{guess} is too high. Go lower."))
    return _chat(messages)


def _numbers_line(rng: random.Random) -> str:
    start = rng.randint(0, 990)
    step = rng.choice((1, 2, 5, 10))
    seq = ", ".join(str(start + i * step) for i in range(rng.randint(4, 9)))
    return f"Counting by {step}: {seq}."


def _comparison_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 1000), rng.randint(0, 1000)
    if a == b:
        return f"{a} is equal to {b}."
    word = "higher" if a > b else "lower"
    return f"{a} is {word} than {b}, so the guess {a} is too {'high' if a > b else 'low'}."


_MAKERS = (
    (_story_line, 5),
    (_arithmetic_line, 6),
    (_word_problem_line, 2),
    (_qa_chat, 2),
    (_guess_chat, 1),
    (_numbers_line, 1),
    (_comparison_line, 2),
)


def generate_corpus(*, seed: int = CORPUS_SEED, target_chars: int = 75_000) -> str:
    """The corpus text: the hand-written prose, then generated lines until ``target_chars``."""
    if target_chars <= 0:
        raise ValueError(f"target_chars must be positive, got {target_chars}; pass e.g. 75_000.")
    rng = random.Random(seed)
    makers, weights = zip(*_MAKERS, strict=True)
    lines = _prose_lines()
    size = sum(len(line) + 1 for line in lines)
    while size < target_chars:
        line = rng.choices(makers, weights=weights)[0](rng)
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def write_corpus(path: Path = CORPUS_PATH) -> Path:
    """Write the corpus to ``path`` (default: the packaged ``corpus.txt``)."""
    text = generate_corpus()
    path.write_text(text, encoding="utf-8")
    logger.info("wrote %d characters to %s", len(text), path)
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    write_corpus()
