"""The benchmark prompt: fixed text, tokenized by the model's own tokenizer and truncated.

The same ids go to every engine, and their hash is reported, so runs compare like with like.
"""

from __future__ import annotations

import hashlib

TEXT = """\
The harbour town woke slowly on winter mornings. Fishing boats came in on the tide, their decks \
shining with ice, and the gulls followed them in long untidy lines. In the market hall the \
traders set out crates of cod and mackerel, baskets of mussels, and the first pale oranges of \
the season, shipped up from the south. Children on their way to school stopped to watch the \
auctioneer, who spoke so fast that only the fishermen could follow him.

At the top of the hill stood the observatory, built a century earlier by a merchant who had \
made his fortune in tea and lost his heart to the stars. Its copper dome had turned green, and \
the telescope inside was older than anyone in the town, but on clear nights the lights were \
still on. The astronomer who lived there kept careful notes: the brightness of variable stars, \
the paths of comets, the slow drift of the planets against the constellations. Every morning \
she walked down the hill to buy bread, and every evening she climbed back up with a bag of \
apples and a newspaper she rarely had time to read.

Engineers from the capital arrived in the spring to install a new weather station on the pier. \
They brought sensors that measured wind, pressure, humidity and the temperature of the sea, and \
a small computer that sent the readings to a server far away. The old harbour master watched \
them with suspicion. For forty years he had forecast the weather by looking at the sky and \
listening to his knees, and he saw no reason to change. But when a storm arrived two days \
earlier than his knees had predicted, and the station's warning kept the boats in port, he \
invited the engineers for dinner and asked them to explain, slowly, how the machine had known.

Over the summer the town changed in small ways. The library bought a set of tablets for \
children who had none at home. The baker began taking orders through an app that his daughter \
had built in a weekend. The ferry company published its timetable online and, to everyone's \
surprise, began to run on time. Nobody could say exactly when the town had become modern; it \
had happened one convenience at a time, each too small to notice, until one day the old ways \
were simply gone.

In autumn the astronomer gave a public lecture in the market hall. She spoke about the age of \
the universe, the birth and death of stars, and the chemistry that links the iron in our blood \
to explosions that happened billions of years ago. The fishermen listened with their caps in \
their hands. At the end, a boy asked her whether she was ever afraid of how large and empty the \
sky was. She thought for a long time before answering that she was not afraid, because every \
night the sky came back, and every night there was something new to see in it.
"""


def benchmark_ids(tokenizer, n_prompt: int) -> list[int]:
    """``n_prompt`` token ids of the fixed text (repeated as needed), BOS as the model adds it."""
    ids = tokenizer.encode(TEXT, special=False)
    if not ids:
        raise ValueError("the tokenizer produced no tokens for the benchmark text")
    body = [i for i in ids if i != tokenizer.bos_id]
    out = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    while len(out) < n_prompt:
        out.extend(body)
    return out[:n_prompt]


def ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
